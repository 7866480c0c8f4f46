"""A progress bar for long runs: tqdm when installed, a plain stderr counter otherwise.

A bar redraws its line with a carriage return, which only a terminal understands: in a log
file or a CI log every redraw, and the next output, would run together on one line. When
stderr is not a terminal, progress is written as whole lines instead, about ten per run.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

__all__ = ["progress"]

# Lines written over a run when stderr is not a terminal (and the total is known).
_LOG_LINES = 10


def progress(items: Iterable[T], total: int | None = None, desc: str = "") -> Iterator[T]:
    """Iterate ``items`` with a progress bar on stderr (progress lines when not a terminal)."""
    if not sys.stderr.isatty():
        yield from _lines(items, total, desc)
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield from _bar(items, total, desc)
        return
    yield from tqdm(items, total=total, desc=desc, file=sys.stderr, leave=False)


def _bar(items: Iterable[T], total: int | None, desc: str) -> Iterator[T]:
    count = 0
    for count, item in enumerate(items, 1):
        suffix = f"/{total}" if total else ""
        print(f"\r{desc} {count}{suffix}", end="", file=sys.stderr, flush=True)
        yield item
    if count:
        print(file=sys.stderr)


def _lines(items: Iterable[T], total: int | None, desc: str) -> Iterator[T]:
    every = max(1, math.ceil(total / _LOG_LINES)) if total else 1
    count = 0
    for count, item in enumerate(items, 1):
        yield item  # the line reports the item as done
        if count % every == 0 or count == total:
            suffix = f"/{total}" if total else ""
            print(f"{desc} {count}{suffix}", file=sys.stderr, flush=True)
