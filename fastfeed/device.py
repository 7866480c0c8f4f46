"""Device prefetch: copy batches to the GPU on a side stream, some batches ahead.

Each host batch is copied ``non_blocking`` on one copy stream per loader, and
``gpu_transform`` runs on that stream right after the copy. An event marks the end of that
work. The consumer's stream waits on the event, and every device tensor is marked with
``record_stream`` so that the caching allocator does not hand its memory out again while the
consumer may still use it. The host batch (and with it its ring slot) is kept until the event
has completed: a slot is never released while the copy engine can still read it.

On ``device="cpu"`` the same code path runs without streams or events.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fastfeed.telemetry import Telemetry, batch_length
from fastfeed.tree import map_tensors

__all__ = ["DeviceIterator", "check_device", "resolve_device"]


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
    """:func:`check_device`; a bare ``"cuda"`` means this process's GPU (LOCAL_RANK under
    torchrun).

    Raises:
        ValueError: the string is not a device, or CUDA is requested but unavailable.
    """
    resolved = check_device(device)
    if resolved.type == "cuda" and resolved.index is None:
        local_rank = os.environ.get("LOCAL_RANK")
        index = int(local_rank) if local_rank is not None else torch.cuda.current_device()
        resolved = torch.device("cuda", index)
    return resolved


def _to_device(device: torch.device, non_blocking: bool) -> Callable[[torch.Tensor], Any]:
    def move(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device, non_blocking=non_blocking)

    return move


class DeviceIterator:
    """Wraps a host iterator; yields batches already on ``device``, ``depth`` batches ahead."""

    def __init__(
        self,
        host: Iterator[Any],
        device: torch.device,
        depth: int,
        transform: Callable[[Any], Any] | None,
        stream: Any = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._host = host
        self._telemetry = telemetry or Telemetry()
        self._device = device
        self._depth = depth
        self._transform = transform
        self._stream = stream  # None on CPU
        self._move = _to_device(device, non_blocking=stream is not None)
        # (device batch, event, host batch, the host's snapshot after handing it over)
        self._ready: deque[tuple[Any, Any, Any, Any]] = deque()
        self._in_flight: deque[tuple[Any, Any]] = deque()  # (event, host batch) being read
        self._exhausted = False
        # Batches copied ahead are not delivered yet: resume from the last delivered one.
        self._delivered_state = self._host_state()

    def __iter__(self) -> DeviceIterator:
        return self

    def __len__(self) -> int:
        return len(self._host)  # type: ignore[arg-type]

    def state_dict(self) -> Any:
        """The host iterator's snapshot as of the last batch this iterator delivered."""
        return self._delivered_state

    def _host_state(self) -> Any:
        # torch's own iterators (used for DataPipes) keep no snapshot.
        return self._host.state_dict() if hasattr(self._host, "state_dict") else None

    def close(self) -> None:
        """Drop the batches copied ahead, then close the host iterator."""
        if self._stream is not None:
            self._stream.synchronize()  # the copies still read the host batches
        self._ready.clear()
        self._in_flight.clear()
        self._exhausted = True
        if hasattr(self._host, "close"):
            self._host.close()

    def _stage(self, host_batch: Any) -> tuple[Any, Any, Any]:
        if self._stream is None:
            return self._copy_and_transform(host_batch), None, None
        with torch.cuda.stream(self._stream):
            batch = self._copy_and_transform(host_batch)
            event = torch.cuda.Event()
            event.record(self._stream)
        return batch, event, host_batch

    def _copy_and_transform(self, host_batch: Any) -> Any:
        # On CUDA these are the host-side times to enqueue the work, not the GPU's.
        start = time.perf_counter()
        batch = map_tensors(self._move, host_batch)
        copied = time.perf_counter()
        self._telemetry.add_stage("transfer", copied - start)
        if self._transform is not None:
            batch = self._transform(batch)
            self._telemetry.add_stage("gpu_transform", time.perf_counter() - copied)
        return batch

    def _fill(self) -> None:
        while not self._exhausted and len(self._ready) < self._depth:
            try:
                host_batch = next(self._host)
            except StopIteration:
                self._exhausted = True
                return
            self._ready.append((*self._stage(host_batch), self._host_state()))

    def _release_copied(self) -> None:
        # Host batches (and their ring slots) go only once the copy engine is done with them.
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.popleft()

    def __next__(self) -> Any:
        requested = time.perf_counter()
        self._release_copied()
        self._fill()
        if not self._ready:
            self._delivered_state = self._host_state()
            raise StopIteration
        batch, event, host_batch, self._delivered_state = self._ready.popleft()
        if event is not None:
            consumer = torch.cuda.current_stream(self._device)
            consumer.wait_event(event)

            def mark(tensor: torch.Tensor) -> torch.Tensor:
                if tensor.is_cuda:
                    tensor.record_stream(consumer)
                return tensor

            map_tensors(mark, batch)
            self._in_flight.append((event, host_batch))
        self._telemetry.delivered(requested, batch_length(batch, auto_collation=True))
        self._fill()  # queue the next copies now, so that they overlap the consumer's step
        return batch
