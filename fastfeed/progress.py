"""A progress bar for long runs: tqdm when installed, a plain stderr counter otherwise."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

__all__ = ["progress"]


def progress(items: Iterable[T], total: int | None = None, desc: str = "") -> Iterator[T]:
    """Iterate ``items`` with a progress bar on stderr."""
    try:
        from tqdm import tqdm
    except ImportError:
        yield from _plain(items, total, desc)
        return
    yield from tqdm(items, total=total, desc=desc, file=sys.stderr, leave=False)


def _plain(items: Iterable[T], total: int | None, desc: str) -> Iterator[T]:
    count = 0
    for count, item in enumerate(items, 1):
        suffix = f"/{total}" if total else ""
        print(f"\r{desc} {count}{suffix}", end="", file=sys.stderr, flush=True)
        yield item
    if count:
        print(file=sys.stderr)
