"""FastLoader's own keyword arguments, checked in its constructor as DataLoader checks its
own: the same exception types, and messages that say what to pass instead."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from fastfeed._torch_compat import is_iterable_dataset
from fastfeed.backends.ray.cluster import actor_options

__all__ = ["WORKER_MODES", "check_arguments", "cores_warning_muted"]

WORKER_MODES = ("process", "thread", "auto", "ray")


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_arguments(*, dataset: Any, worker_mode: Any, ray_options: Any, deterministic: bool,
                    log_every: Any, ring_slots: Any, prefetch_depth: Any, gpu_transform: Any,
                    device: Any, share_lists: Any = True) -> dict[str, Any] | None:
    """Raise on an argument FastLoader cannot take; return the Ray actor options with
    ``worker_mode="ray"`` (None otherwise).

    Raises:
        ValueError, TypeError: a bad value or combination.
        ImportError: ``worker_mode="ray"`` without Ray installed.
    """
    if worker_mode not in WORKER_MODES:
        raise ValueError(f"worker_mode should be one of {', '.join(map(repr, WORKER_MODES))}, "
                         f"got {worker_mode!r}")
    if worker_mode == "thread" and is_iterable_dataset(dataset):
        raise ValueError("worker_mode='thread' needs a map-style dataset: IterableDataset "
                         "replicas shard by get_worker_info(), which threads cannot give")
    if worker_mode == "thread" and deterministic:
        raise ValueError("deterministic=True reseeds the global RNGs per sample, which "
                         "threads share: use worker_mode='process'")
    if ray_options is not None and worker_mode != "ray":
        raise ValueError(f"ray_options places Ray actors: it needs worker_mode='ray', got "
                         f"worker_mode={worker_mode!r}")
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
    return actor_options(ray_options) if worker_mode == "ray" else None


@contextlib.contextmanager
def cores_warning_muted(worker_mode: str) -> Iterator[None]:
    """Mute torch's warning that more workers than this machine's cores may freeze it, for Ray's
    workers, which use the cluster's cores; other modes keep it exactly as torch gives it."""
    if worker_mode != "ray":
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        yield
