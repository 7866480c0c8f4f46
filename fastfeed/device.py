"""Device prefetch: copy batches to the GPU on a side stream, some batches ahead.

Each host batch is copied ``non_blocking`` from page-locked memory on one copy stream per
loader, and ``gpu_transform`` runs on that stream right after the copy. An event marks the end
of that work; the ring slots the copy read are fenced with it, the consumer's stream waits on
it, and every device tensor is marked with ``record_stream`` (:class:`StreamCopier`).

On ``device="cpu"`` the same path runs without streams or events (:class:`HostCopier`).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from fastfeed.iterators.base import HostBatch
from fastfeed.placement import local_cuda_index
from fastfeed.telemetry import Telemetry, batch_length
from fastfeed.tree import map_arrays, map_tensors

__all__ = [
    "DeviceIterator",
    "HostCopier",
    "HostIterator",
    "StreamCopier",
    "TorchIteratorHost",
    "check_device",
    "pinned_source",
    "resolve_device",
]


def check_device(device: str | int | torch.device) -> torch.device:
    """Parse ``device`` and check that this machine has it, without initialising CUDA.

    Raises:
        ValueError: the string is not a device, or CUDA is requested but unavailable.
    """
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device={device!r} is not a valid torch device: {error}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} was requested but CUDA is not available "
            "(torch.cuda.is_available() is False); use device='cpu' or None"
        )
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: fastfeed prefetches to 'cpu' or 'cuda' devices")
    return resolved


def resolve_device(device: str | int | torch.device) -> torch.device:
    """:func:`check_device`, with the index of this process's GPU filled in.

    A bare ``"cuda"`` means ``LOCAL_RANK``'s GPU when the process sees several (torchrun),
    GPU 0 when it sees one (a launcher that sets ``CUDA_VISIBLE_DEVICES`` per rank), else the
    current device (see :func:`fastfeed.placement.local_cuda_index`). Call it when the
    training script has chosen its device, not before.

    Raises:
        ValueError: the string is not a device, CUDA is requested but unavailable, or the
            index does not name a device this process sees.
    """
    resolved = check_device(device)
    if resolved.type != "cuda":
        return resolved
    current = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    index = local_cuda_index(resolved.index, os.environ.get("LOCAL_RANK"),
                             torch.cuda.device_count(), current)
    return torch.device("cuda", index)


def pinned_source(tensor: torch.Tensor) -> torch.Tensor:
    """What a ``non_blocking`` host-to-device copy of ``tensor`` should read.

    Page-locked memory (a registered ring slot, torch's pinned pool) as it is. Anything else
    is copied into torch's pinned pool first: from pageable memory a "non_blocking" copy is
    staged synchronously, and torch's pool keeps its block until the copy's stream is done.
    """
    return tensor if tensor.is_pinned() else tensor.pin_memory()


class HostCopier:
    """``device="cpu"``: the same path with no streams, events or pinning."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def copy(self, host_batch: Any, transform: Callable[[Any], Any] | None,
             telemetry: Telemetry) -> tuple[Any, Any, list[torch.Tensor]]:
        """Copy (and transform) a batch; return it, its event and the host tensors read."""
        return _timed_copy(host_batch, lambda t: t.to(self.device), transform, telemetry), None, []

    def hand_over(self, batch: Any, event: Any) -> None:
        """Make ``batch`` safe to use on the consumer's stream."""


class StreamCopier:
    """Copies batches to a CUDA device on a side stream: the CUDA stream rules in one place.

    * Every copy reads page-locked memory (:func:`pinned_source`), so it is asynchronous.
    * Numpy leaves are copied out of the slot on the host: the user may copy them, unfenced.
    * The copy and ``gpu_transform`` run on ``stream``; an event recorded after them marks
      the end of everything that reads the host batch. The caller fences the batch's ring
      slot (its lease) with that event: the slot is not reused before it completes, whatever
      happens to the host batch (DESIGN.md invariant 2).
    * The consumer's current stream waits on the event, and every device tensor is marked
      with ``record_stream`` so that the caching allocator does not reuse its memory while
      the consumer's stream may still read it.
    * Nothing here waits on the GPU from the host.
    """

    def __init__(self, device: torch.device, stream: Any) -> None:
        self.device = device
        self.stream = stream

    def copy(self, host_batch: Any, transform: Callable[[Any], Any] | None,
             telemetry: Telemetry) -> tuple[Any, Any, list[torch.Tensor]]:
        read: list[torch.Tensor] = []

        def move(tensor: torch.Tensor) -> torch.Tensor:
            source = pinned_source(tensor)
            if source is tensor:
                read.append(tensor)  # the copy engine reads the host batch's own memory
            return source.to(self.device, non_blocking=True)

        # Numpy leaves stay on the host, where the user may copy them to the GPU themselves
        # (torch.from_numpy(x).cuda(non_blocking=True)), unseen by the slot's fence: they get
        # memory of their own, not a view of a page-locked slot.
        host_batch = map_arrays(np.copy, host_batch)
        with torch.cuda.stream(self.stream):
            batch = _timed_copy(host_batch, move, transform, telemetry)
            event = torch.cuda.Event()
            event.record(self.stream)
        return batch, event, read

    def hand_over(self, batch: Any, event: Any) -> None:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)

        def mark(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.is_cuda:
                tensor.record_stream(consumer)
            return tensor

        map_tensors(mark, batch)


Copier = HostCopier | StreamCopier


def _timed_copy(host_batch: Any, move: Callable[[torch.Tensor], torch.Tensor],
                transform: Callable[[Any], Any] | None, telemetry: Telemetry) -> Any:
    # On CUDA these are the host-side times to enqueue the work, not the GPU's.
    start = time.perf_counter()
    batch = map_tensors(move, host_batch)
    copied = time.perf_counter()
    telemetry.add_stage("transfer", copied - start)
    if transform is not None:
        batch = transform(batch)
        telemetry.add_stage("gpu_transform", time.perf_counter() - copied)
    return batch


class HostIterator(Protocol):
    """What the device stage needs of the iterator it wraps (see
    :class:`fastfeed.iterators.base.BaseIterator`)."""

    base_seed: int
    device_tail: Callable[[Any], Any] | None

    def next_host_batch(self) -> HostBatch: ...

    def position(self) -> Any: ...

    def state_at(self, position: Any) -> Any: ...

    def close(self) -> None: ...

    def __len__(self) -> int: ...


class DeviceIterator:
    """Wraps a host iterator; yields batches already on the device, ``depth`` batches ahead.

    The host batch is dropped as soon as its copy is queued: the slot the copy reads is
    fenced with the copy's event through the batch's lease, and memory from torch's pinned
    pool is guarded by torch. So neither an abandoned iterator nor a slow consumer can let a
    slot be rewritten under a copy still queued.
    """

    def __init__(
        self,
        host: HostIterator,
        copier: Copier,
        depth: int,
        transform: Callable[[Any], Any] | None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._host = host
        self._copier = copier
        self._telemetry = telemetry or Telemetry()
        self._depth = depth
        self._transform = transform
        # (device batch, event, where the host stood after handing its batch over)
        self._ready: deque[tuple[Any, Any, Any]] = deque()
        self._exhausted = False
        # Batches copied ahead are not delivered yet: resume from the last delivered one.
        self._delivered_at = host.position()

    def __iter__(self) -> DeviceIterator:
        return self

    def __len__(self) -> int:
        return len(self._host)

    def state_dict(self) -> Any:
        """The host iterator's snapshot as of the last batch this iterator delivered."""
        return self._host.state_at(self._delivered_at)

    def close(self) -> None:
        """Drop the batches copied ahead, then close the host iterator (the fences keep the
        slots those copies read until they complete)."""
        self._ready.clear()
        self._exhausted = True
        self._host.close()

    def _fill(self) -> None:
        while not self._exhausted and len(self._ready) < self._depth:
            try:
                host_batch, lease = self._host.next_host_batch()
            except StopIteration:
                self._exhausted = True
                return
            batch, event, read = self._copier.copy(host_batch, self._transform, self._telemetry)
            if event is not None and read and lease is not None:
                lease.fence(event)
            self._ready.append((batch, event, self._host.position()))

    def __next__(self) -> Any:
        requested = time.perf_counter()
        self._fill()
        if not self._ready:
            self._delivered_at = self._host.position()
            raise StopIteration
        batch, event, self._delivered_at = self._ready.popleft()
        if event is not None:
            self._copier.hand_over(batch, event)
        self._telemetry.delivered(requested, batch_length(batch, auto_collation=True))
        self._fill()  # queue the next copies now, so that they overlap the consumer's step
        return batch


class TorchIteratorHost:
    """torch's own iterators (DataPipes run on them) as a host: batches without leases, and
    no snapshots."""

    device_tail = None

    def __init__(self, iterator: Any) -> None:
        self._iterator = iterator
        self.base_seed: int = iterator._base_seed

    def next_host_batch(self) -> HostBatch:
        return HostBatch(next(self._iterator), None)

    def position(self) -> None:
        return None

    def state_at(self, position: Any) -> Any:
        raise TypeError("DataPipe datasets run on torch's iterators and cannot be resumed")

    def close(self) -> None:
        pass

    def __len__(self) -> int:
        return len(self._iterator)
