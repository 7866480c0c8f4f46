"""Sync-aware waiting on CUDA: how long the GPU sat idle while the script waited for a batch.

On CUDA the host runs ahead of the GPU: a script can wait in ``next()`` while the GPU is still
busy with the kernels queued before, so the host's wait overstates the stall. An event recorded
on the current stream when the script asks for a batch completes when the GPU has finished
everything queued before it; one recorded when the batch arrives completes at once if the GPU
is by then idle. The time between the two, on the GPU's clock, is the time the GPU had nothing
to do because the batch was late: zero when the host's wait was hidden by queued work.

The events are recorded on the current stream of the GPU the script trains on
(:func:`~fastfeed.device.training_device`: the script's ``set_device``, else ``LOCAL_RANK``'s
GPU, else the one GPU with a context): not on the thread's current device, which is GPU 0 in a
script that never sets it (timing GPU 0, and making a context there from every rank).

Events are read when they have completed (``query``), never by waiting on them in the hot path;
:meth:`GpuWaits.finish` waits for the last few at the end of the window. Nothing here touches
CUDA unless the script has initialised it: the doctor must not create a CUDA context before
the script forks its workers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from fastfeed.device import training_device

__all__ = ["Event", "GpuWaits"]


class Event(Protocol):
    """The part of ``torch.cuda.Event`` used here (tests pass a stand-in)."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Any) -> float: ...


def _cuda_in_use() -> bool:
    return torch.cuda.is_initialized()  # never true without a GPU; a flag read, per batch


def _timing_event() -> Event:
    return torch.cuda.Event(enable_timing=True)


def _training_stream() -> Any:
    """The current stream of the GPU the script trains on (see the module's notes)."""
    return torch.cuda.current_stream(training_device())


class GpuWaits:
    """Per batch index, the seconds the GPU was idle waiting for that batch.

    Args:
        active: whether to record events now (default: the script has initialised CUDA).
        event: makes a timing event (default: ``torch.cuda.Event(enable_timing=True)``).
        stream: the stream the events are recorded on, asked once (default: the current
            stream of the GPU the script trains on).
    """

    def __init__(self, active: Callable[[], bool] = _cuda_in_use,
                 event: Callable[[], Event] = _timing_event,
                 stream: Callable[[], Any] = _training_stream) -> None:
        self._active, self._event, self._stream_of = active, event, stream
        self._stream: Any = None
        self._pending: deque[tuple[int, Event, Event]] = deque()
        self.idle_s: dict[int, float] = {}

    def request(self) -> Event | None:
        """The script asks for a batch: mark the stream, if CUDA is in use."""
        if not self._active():
            return None
        if self._stream is None:
            self._stream = self._stream_of()
        mark = self._event()
        mark.record(self._stream)
        return mark

    def deliver(self, index: int, requested: Event | None) -> None:
        """Batch ``index`` arrived; read whichever earlier pairs have completed."""
        if requested is None:
            return
        arrived = self._event()
        arrived.record(self._stream)
        self._pending.append((index, requested, arrived))
        while self._pending and self._pending[0][2].query():
            self._read(*self._pending.popleft())

    def finish(self) -> None:
        """Wait for the events still pending and read them (at the end of the window)."""
        while self._pending:
            index, requested, arrived = self._pending.popleft()
            arrived.synchronize()
            self._read(index, requested, arrived)

    def _read(self, index: int, requested: Event, arrived: Event) -> None:
        self.idle_s[index] = requested.elapsed_time(arrived) / 1000
