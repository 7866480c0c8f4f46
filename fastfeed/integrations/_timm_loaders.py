"""timm's loader classes with FastLoader underneath (imported by ``patch()`` only: needs timm)."""

from __future__ import annotations

from timm.data.loader import MultiEpochsDataLoader

from fastfeed.loader import FastLoader

__all__ = ["MultiEpochsFastLoader"]


class MultiEpochsFastLoader(MultiEpochsDataLoader, FastLoader):
    """timm's ``MultiEpochsDataLoader`` (one iterator, its workers kept across epochs) over a
    :class:`~fastfeed.FastLoader`."""
