"""FastLoader's own keyword arguments, checked in its constructor as DataLoader checks its
own: the same exception types, and messages that say what to pass instead."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from fastfeed.backends import backends_for, checked_placement

__all__ = ["check_arguments", "cores_warning_muted"]


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_arguments(*, dataset: Any, worker_mode: Any, ray_options: Any, deterministic: bool,
                    log_every: Any, ring_slots: Any, prefetch_depth: Any, gpu_transform: Any,
                    device: Any, share_lists: Any = True) -> dict[str, Any] | None:
    """Raise on an argument FastLoader cannot take; return where the workers go, as the
    ``worker_mode``'s backend checked ``ray_options`` (None for a backend that takes none).

    Raises:
        ValueError, TypeError: a bad value or combination.
        ImportError: a backend that needs a library that is not installed (Ray).
    """
    placement = checked_placement(worker_mode, dataset, deterministic, ray_options)
    if log_every is not None and not _is_int(log_every, minimum=1):
        raise ValueError(f"log_every should be None or a positive int, got {log_every!r}")
    if ring_slots is not None and not _is_int(ring_slots, minimum=0):
        raise ValueError(f"ring_slots should be None or a non-negative int, got {ring_slots!r}")
    if not _is_int(prefetch_depth, minimum=1):
        raise ValueError(f"prefetch_depth should be a positive int, got {prefetch_depth!r}")
    if gpu_transform is not None and not callable(gpu_transform):
        raise TypeError(f"gpu_transform should be callable, got {type(gpu_transform).__name__}")
    if gpu_transform is not None and device is None:
        raise ValueError("gpu_transform runs on the device: pass device='cuda' (or 'cpu')")
    if not isinstance(share_lists, bool):
        raise TypeError(f"share_lists should be a bool, got {type(share_lists).__name__}")
    return placement


@contextlib.contextmanager
def cores_warning_muted(worker_mode: str) -> Iterator[None]:
    """Mute torch's warning that more workers than this machine's cores may freeze it, for
    workers on a cluster's cores; workers on this machine keep it exactly as torch gives it."""
    if not any(b.traits.uses_cluster_cores for b in backends_for(worker_mode)):
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        yield
