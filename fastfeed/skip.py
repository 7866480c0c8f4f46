"""Dropping bad samples: a dataset returns :data:`SKIP` and the loader leaves it out.

Image datasets built with ``on_error="skip"`` return it for a corrupt file. The fetcher drops
it before collation and counts it; ``loader.stats().skipped_samples`` reports the total.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SKIP", "drop_skipped"]


class _Skip:
    _instance: _Skip | None = None

    def __new__(cls) -> _Skip:  # one instance, also after pickling into a worker and back
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self) -> tuple:
        return (_Skip, ())

    def __repr__(self) -> str:
        return "fastfeed.SKIP"


SKIP: Any = _Skip()


def drop_skipped(samples: Any, batched: bool) -> tuple[Any, int]:
    """``(samples without SKIP, how many were dropped)``.

    Only a batch's list of samples is filtered (``batched``: automatic batching; otherwise a
    list is one sample's own content), and only when it holds a SKIP: anything else passes
    through as it is, a list subclass from ``__getitems__`` included.
    """
    if not batched or not isinstance(samples, list) or not any(s is SKIP for s in samples):
        return samples, 0
    kept = [s for s in samples if s is not SKIP]
    return kept, len(samples) - len(kept)
