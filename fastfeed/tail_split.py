"""Batch tails: how an integration lets a dataset's items stop early and finishes them on
whole batches, without the core knowing the integration.

A dataset opts in through its ``transform``: an object with ``split_batch_tail(dataset)``
returning a :class:`BatchTailSplit` (``fastfeed.vision.accelerate`` gives its transforms
one). The loader then ships the split's ``dataset``, whose items stop at, say, uint8 images,
and finishes each batch with the split's tail (:func:`plan_tail` says where):

- with a ``device``, on the device, on the copy stream: a quarter of the bytes cross to it;
- with Ray workers, in the main process as it lands each batch in its pool slot: a quarter of
  the bytes cross the object store (and the network), and the tail's float output is written
  where a plain copy would have written it;
- else in the workers, where the split's ``collate`` writes the finished batch straight into
  the pool slot.

The values are those of the per-sample pipeline.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

from fastfeed._torch_compat import default_collate
from fastfeed.collate import Empty, SlotCollate

__all__ = ["BatchTailSplit", "TailPlan", "batch_tail_split", "plan_tail"]


@dataclass(frozen=True)
class BatchTailSplit:
    """A dataset whose items stop early, and how to finish its batches.

    Attributes:
        dataset: the dataset the workers read.
        tail: finishes a batch of ``dataset``'s items as ``default_collate`` gives them (on
            any device, without a host sync).
        collate: ``default_collate`` then ``tail``, writing its output with the slot's
            allocator: what the workers run when there is no device (``None``: the tail
            runs only on a device).
        tail_into: ``tail_into(batch, empty)``, ``tail`` writing its output with a slot's
            allocator: what the main process runs on a batch from Ray workers as it lands it
            (``None``: the tail runs only on a device).
        device_collate: what the workers collate with when the tail runs on the device
            (``None``: the loader's ``collate_fn``).
        needs_device: the error's message for a loader without a device, when the tail runs
            only on one.
    """

    dataset: Dataset
    tail: Callable[[Any], Any]
    collate: SlotCollate | None
    tail_into: Callable[[Any, Empty], Any] | None
    device_collate: Callable[[list], Any] | None = None
    needs_device: str = ""


@dataclass(frozen=True)
class TailPlan:
    """Where one host iterator finishes a split's batches; the default, without a split: nowhere.

    Attributes:
        dataset: what the workers read instead of the loader's dataset.
        collate_fn: what the workers collate with instead of the loader's ``collate_fn``.
        device_tail: what the device stage runs on each batch first.
        landing_tail: what the Ray backend runs on each batch as it lands it in a pool slot
            (``tail_into(batch, empty)``).
    """

    dataset: Dataset | None = None
    collate_fn: Callable[[list], Any] | None = None
    device_tail: Callable[[Any], Any] | None = None
    landing_tail: Callable[[Any, Empty], Any] | None = None


def batch_tail_split(dataset: Any, collate_fn: Any, auto_collation: bool
                     ) -> BatchTailSplit | None:
    """The split a dataset's transform offers, where it applies: only with automatic batching
    and torch's default collate, whose output the tail knows.

    Elsewhere the items are made whole in the workers, the per-sample way; for a split whose
    tail runs only on a device (the GPU decode, which the user asked for by name), with a
    warning that says so.
    """
    offer = getattr(getattr(dataset, "transform", None), "split_batch_tail", None)
    if not callable(offer):
        return None
    split: BatchTailSplit | None = offer(dataset)
    if collate_fn is default_collate and auto_collation:
        return split
    if split is not None and split.collate is None:
        why = "a collate_fn of its own" if auto_collation else "batch_size=None"
        warnings.warn(f"fastfeed: this loader has {why}, so the dataset's batches cannot be "
                      "finished on the device (the GPU decode): its items are made whole in "
                      "the workers, on the CPU", stacklevel=2)
    return None


def plan_tail(split: BatchTailSplit | None, on_device: bool, lands_batches: bool
               ) -> TailPlan:
    """Where ``split``'s tail runs: on the device when there is one; as this process lands
    the workers' batches, where it does (Ray's: they cross the object store as the split's
    short items collate, uint8 for images); else in the workers, into the pool slot.

    Raises:
        ValueError: the split's tail runs only on a device, and there is none.
    """
    if split is None:
        return TailPlan()
    if on_device:
        return TailPlan(split.dataset, split.device_collate, device_tail=split.tail)
    if split.collate is None or split.tail_into is None:
        raise ValueError(split.needs_device)
    if lands_batches:
        return TailPlan(split.dataset, landing_tail=split.tail_into)
    return TailPlan(split.dataset, collate_fn=split.collate)
