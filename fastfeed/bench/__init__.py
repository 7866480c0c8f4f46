"""``fastfeed bench``: measure what the swap buys, on your own data and hardware."""

from fastfeed.bench.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
