"""Where workers run, behind one protocol (:mod:`fastfeed.backends.interface`): processes (the
default; batches cross through the slot pool), threads, or Ray actors on a cluster
(:mod:`fastfeed.backends.ray`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastfeed.backends.interface import WorkerBackend, WorkerExited, WorkerHandle, WorkerKind
from fastfeed.backends.process import ProcessBackend
from fastfeed.backends.thread import ThreadBackend
from fastfeed.collate import Empty
from fastfeed.slots import SlotPool

__all__ = ["WorkerBackend", "WorkerExited", "WorkerHandle", "WorkerKind", "make_backend"]


def make_backend(mode: WorkerKind, slot_pool: SlotPool | None,
                 multiprocessing_context: Any = None,
                 ray_options: dict[str, Any] | None = None,
                 landing_tail: Callable[[Any, Empty], Any] | None = None,
                 share_lists: bool = True) -> WorkerBackend:
    """The backend for ``worker_mode`` ``mode``; process workers and Ray's landing write
    ``slot_pool``'s slots (Ray's finishes each batch with ``landing_tail`` as it lands it, if
    given); process workers read the dataset's large lists from one shared copy if
    ``share_lists``."""
    if mode == "thread":
        return ThreadBackend()
    if mode == "ray":
        # Only when asked for: it connects to Ray.
        from fastfeed.backends.ray.backend import RayBackend

        return RayBackend(slot_pool, ray_options, landing_tail)
    return ProcessBackend(multiprocessing_context or torch.multiprocessing, slot_pool, share_lists)
