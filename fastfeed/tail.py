"""Batch tails: how an integration lets a dataset's items stop early and finishes them on
whole batches, without the core knowing the integration.

A dataset opts in through its ``transform``: an object with ``split_batch_tail(dataset)``
returning a :class:`BatchTailSplit` (``fastfeed.vision.accelerate`` gives its transforms
one). The loader then ships the split's ``dataset``, whose items stop at, say, uint8 images,
and finishes each batch with the split's ``tail``: on the device, on the copy stream, when the
loader has a ``device`` (a quarter of the bytes cross to it), else in the workers, where the
split's ``collate`` writes the finished batch straight into the ring slot. The values are
those of the per-sample pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

from fastfeed._torch_compat import default_collate
from fastfeed.collate import SlotCollate

__all__ = ["BatchTailSplit", "batch_tail_split"]


@dataclass(frozen=True)
class BatchTailSplit:
    """A dataset whose items stop early, and how to finish its batches.

    Attributes:
        dataset: the dataset the workers read.
        tail: finishes a batch of ``dataset``'s items as ``default_collate`` gives them (on
            any device, without a host sync).
        collate: ``default_collate`` then ``tail``, writing its output with the slot's
            allocator: what the workers run when there is no device.
    """

    dataset: Dataset
    tail: Callable[[Any], Any]
    collate: SlotCollate


def batch_tail_split(dataset: Any, collate_fn: Any, auto_collation: bool
                     ) -> BatchTailSplit | None:
    """The split a dataset's transform offers, where it applies: only with automatic batching
    and torch's default collate, whose output the tail knows."""
    if collate_fn is not default_collate or not auto_collation:
        return None
    split = getattr(getattr(dataset, "transform", None), "split_batch_tail", None)
    return split(dataset) if callable(split) else None
