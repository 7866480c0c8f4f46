"""Copying one host batch to the device: the CUDA stream rules in one place.

Each host batch is copied ``non_blocking`` from page-locked memory on the loader's copy
stream, and the transforms run on that stream right after the copy. An event marks the end
of that work; the batch's pool slot is fenced with it, the consumer's stream waits on it, and
every device tensor is marked with ``record_stream`` (:class:`StreamCopier`).

On ``device="cpu"`` the same path runs without streams or events (:class:`CpuCopier`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastfeed.iterators import HostBatch
from fastfeed.slots import Lease
from fastfeed.telemetry import Telemetry
from fastfeed.tree import map_arrays, map_tensors

__all__ = ["Copier", "CpuCopier", "StreamCopier", "pinned_source"]


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill a block of memory, each once, in some order of its
    dimensions (contiguous, channels_last, a transpose): a copy then reads it as one span."""
    if tensor.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(tensor.shape, tensor.stride(),
                                                           strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def pinned_source(tensor: torch.Tensor) -> torch.Tensor:
    """What a ``non_blocking`` host-to-device copy of ``tensor`` should read.

    The copy engine reads page-locked memory (a registered pool slot, torch's pinned pool)
    where it lies when the tensor is dense; that is returned as it is. Anything else is copied
    into torch's pinned pool first: from pageable memory a "non_blocking" copy is staged
    synchronously, and torch makes a non-dense source contiguous in pageable memory before it
    copies (the same). The pool's block is dense in the tensor's own layout, and torch keeps it
    until the copy's stream has read it.
    """
    if _dense(tensor) and tensor.is_pinned():
        return tensor
    return torch.empty_like(tensor, pin_memory=True).copy_(tensor)


class CpuCopier:
    """``device="cpu"``: the same path with no streams, events or pinning."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def producer(self) -> None:
        """No streams here."""

    def copy(self, host: HostBatch, transform: Callable[[Any], Any] | None,
             telemetry: Telemetry, producer: Any = None) -> tuple[Any, Any]:
        """Copy (and transform) a batch; return it and the event that marks the end of that
        work (None: there is none)."""
        batch = _timed(telemetry, "transfer", map_tensors, lambda t: t.to(self.device),
                       host.batch)
        if transform is not None:
            batch = _timed(telemetry, "gpu_transform", transform, batch)
        return batch, None

    def hand_over(self, batch: Any, event: Any) -> None:
        """Make ``batch`` safe to use on the consumer's stream."""

    def prepare(self, transform: Any) -> None:
        """Run ``transform.prepare(device)`` (work it does once, before its first batch)."""
        transform.prepare(self.device)


class StreamCopier:
    """Copies batches to a CUDA device on a side stream: the CUDA stream rules in one place.

    * Every copy reads page-locked, dense memory (:func:`pinned_source`), so it is
      asynchronous; a tensor already on the device (a dataset that makes CUDA tensors, with
      ``num_workers=0``) is read on the copy stream after the stream it was made on.
    * Every tensor is reached, in any container pickle can rebuild (:func:`map_tensors`
      ``deep``). The codec records every view it made of the batch's slot; one the walk did
      not reach would go to the user as a view of a page-locked slot, which a copy of theirs
      could read after the slot is reused: that batch is refused (``TypeError``).
    * The copy and ``gpu_transform`` run on ``stream``, with the loader's device current (a
      rank makes no context on a GPU it does not use); an event recorded after them, however
      they end, fences the batch's pool slot (its lease): the slot is not reused before the
      event completes, whatever happens to the host batch (docs/design.md, invariant 2).
    * Numpy leaves stay on the host. The transform reads them in the slot (nvjpeg's encoded
      files); those it passes on are copied out of the slot after it, since the user may copy
      them to the GPU themselves, unfenced.
    * The consumer's current stream waits on the event, and every device tensor is marked
      with ``record_stream`` so that the caching allocator does not reuse its memory while
      that stream may still read it. A stream the consumer switches to later is theirs to
      order (``stream.wait_stream(torch.cuda.current_stream())``, ``record_stream``).
    * Nothing here waits on the GPU from the host.
    """

    def __init__(self, device: torch.device, stream: Any) -> None:
        self.device = device
        self.stream = stream

    def producer(self) -> Any:
        """The stream a device tensor of a batch handed over now was made on: the current
        stream of the thread that takes the batch from the host iterator."""
        return torch.cuda.current_stream(self.device)

    def copy(self, host: HostBatch, transform: Callable[[Any], Any] | None,
             telemetry: Telemetry, producer: Any = None) -> tuple[Any, Any]:
        """Copy (and transform) a batch; return it and the event that marks the end of that
        work. ``producer`` is :meth:`producer` as the batch was taken (the copy itself may run
        on a helper thread, whose current stream is another)."""
        producer = self.producer() if producer is None else producer
        moved: set[int] = set()
        waited = False

        def move(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal waited
            moved.add(id(tensor))
            if not tensor.is_cuda:
                return pinned_source(tensor).to(self.device, non_blocking=True)
            if tensor.device != self.device:  # torch orders a peer copy on both devices' streams
                return tensor.to(self.device, non_blocking=True)
            if not waited:  # read on the copy stream: after it is made, and not freed before
                waited = True
                self.stream.wait_stream(producer)
            tensor.record_stream(self.stream)
            return tensor

        event = torch.cuda.Event()
        # The device first: leaving torch.cuda.stream() alone would restore this thread's
        # previous stream with set_stream, which makes its device current (cudaSetDevice) and
        # on CUDA 12 creates its context: device 0's, from a helper thread (every new thread
        # starts there) or a script that never set its device. torch.cuda.device() restores
        # the previous device only where it has a context.
        with torch.cuda.device(self.device):
            try:
                with torch.cuda.stream(self.stream):
                    batch = _timed(telemetry, "transfer", map_tensors, move, host.batch,
                                   deep=True)
                    _check_reached(host, moved)
                    if transform is not None:
                        batch = _timed(telemetry, "gpu_transform", transform, batch)
            finally:
                # Once a copy is queued, however this ends (a transform that raises, a batch
                # refused), the slot waits for the stream to have read it.
                event.record(self.stream)
                if host.lease is not None:
                    host.lease.fence(event)
        return _out_of_slot(batch, host.lease), event

    def prepare(self, transform: Any) -> None:
        """Run ``transform.prepare(device)`` (work it does once, before its first batch, such
        as compiling a kernel) as a copy runs: the device current, on the copy stream."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            transform.prepare(self.device)

    def hand_over(self, batch: Any, event: Any) -> None:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)

        def mark(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device == self.device:
                tensor.record_stream(consumer)
            return tensor

        map_tensors(mark, batch, deep=True)


Copier = CpuCopier | StreamCopier


def _timed(telemetry: Telemetry, stage: str, fn: Callable[..., Any], *args: Any,
           **kwargs: Any) -> Any:
    # On CUDA, the host-side time to enqueue the work, not the GPU's.
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    telemetry.add_stage(stage, time.perf_counter() - start)
    return result


def _check_reached(host: HostBatch, moved: set[int]) -> None:
    """Refuse a batch with a tensor in its pool slot that the copy did not reach."""
    if host.lease is None:
        return
    missed = sum(isinstance(view, torch.Tensor) and id(view) not in moved
                 for view in host.lease.views)
    if missed:
        raise TypeError(
            f"FastLoader(device=...) cannot reach {missed} tensor(s) of a batch of type "
            f"{type(host.batch).__name__}: they would stay on the host as views of a "
            "page-locked pool slot, which a later copy of yours could read after the slot is "
            "reused. Return dicts, lists, tuples, namedtuples, dataclasses or an object that "
            "pickle can rebuild from collate_fn.")


def _out_of_slot(batch: Any, lease: Lease | None) -> Any:
    """``batch`` with every numpy array that is a view of ``lease``'s slot copied out of it."""
    if lease is None or not any(isinstance(view, np.ndarray) for view in lease.views):
        return batch
    start = lease.memory.ctypes.data
    end = start + lease.memory.nbytes

    def copy_out(array: np.ndarray) -> np.ndarray:
        return np.copy(array) if start <= array.__array_interface__["data"][0] < end else array

    return map_arrays(copy_out, batch, deep=True)


