"""Where workers run, behind one protocol (:mod:`fastfeed.backends.base`): processes (the
default; batches cross through the ring), threads, or Ray actors on a cluster
(:mod:`fastfeed.backends.ray`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastfeed.backends.base import WorkerBackend, WorkerExited, WorkerHandle, WorkerKind
from fastfeed.backends.process import ProcessBackend
from fastfeed.backends.thread import ThreadBackend
from fastfeed.collate import Empty
from fastfeed.ring import SlotRing

__all__ = ["WorkerBackend", "WorkerExited", "WorkerHandle", "WorkerKind", "make_backend"]


def make_backend(mode: WorkerKind, ring: SlotRing | None,
                 multiprocessing_context: Any = None,
                 ray_options: dict[str, Any] | None = None,
                 landing_tail: Callable[[Any, Empty], Any] | None = None) -> WorkerBackend:
    """The backend for ``worker_mode`` ``mode``; process workers and Ray's landing write
    ``ring``'s slots (Ray's finishes each batch with ``landing_tail`` as it lands it, if
    given)."""
    if mode == "thread":
        return ThreadBackend()
    if mode == "ray":
        # Only when asked for: it connects to Ray.
        from fastfeed.backends.ray.backend import RayBackend

        return RayBackend(ring, ray_options, landing_tail)
    return ProcessBackend(multiprocessing_context or torch.multiprocessing, ring)
