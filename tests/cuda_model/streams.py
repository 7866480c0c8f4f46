"""Streams and events of the modelled machine: queues that run only when the test (or a host
wait) lets them; each stream belongs to one device, whose context it needs."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cuda_model.device import Gpu

_clock = itertools.count(1)  # the order in which the device reaches points, for elapsed_time


@dataclass(eq=False)
class Mark:
    """A point of a stream's queue; ``done`` once the device got there (at ``reached``)."""

    stream: Stream
    done: bool = False
    reached: int = 0


@dataclass
class Wait:
    mark: Mark


@dataclass
class Kernel:
    name: str
    run: object


class Stream:
    """A CUDA stream of device ``index``: a queue of kernels, points and waits."""

    def __init__(self, gpu: Gpu, name: str, index: int = 0) -> None:
        self.gpu, self.name, self.device_index = gpu, name, index
        self.device = torch.device("cuda", index)
        self.queue: deque = deque()
        gpu.streams.append(self)

    def __repr__(self) -> str:
        return f"<stream {self.name} of cuda:{self.device_index}>"

    def mark(self) -> Mark:
        self.gpu.touch(self.device_index)
        mark = Mark(self)
        self.queue.append(mark)
        return mark

    def wait_event(self, event: Event) -> None:
        if event.recorded is not None:
            self.queue.append(Wait(event.recorded))

    def wait_stream(self, other: Stream) -> None:
        self.queue.append(Wait(other.mark()))

    def query(self) -> bool:
        return not self.queue

    def synchronize(self) -> None:
        self.gpu.sync(f"{self.name}.synchronize()")
        self.gpu.advance(self, self.query)


class Event:
    """``torch.cuda.Event``: recorded on a stream (the current device's current one by
    default), it belongs to that stream's device."""

    def __init__(self, gpu: Gpu) -> None:
        self.gpu = gpu
        self.recorded: Mark | None = None

    def record(self, stream: Stream | None = None) -> None:
        self.recorded = (stream or self.gpu.current_stream()).mark()

    def query(self) -> bool:
        return self.recorded is None or self.recorded.done

    def synchronize(self) -> None:
        self.gpu.sync("Event.synchronize()")
        if self.recorded is not None:
            self.gpu.advance(self.recorded.stream, self.query)

    def elapsed_time(self, end: Event) -> float:
        """The device's steps between the two points, as milliseconds (the model's clock)."""
        assert self.recorded and end.recorded and self.recorded.done and end.recorded.done
        assert self.recorded.stream.device_index == end.recorded.stream.device_index, \
            "events of two devices"
        return float(end.recorded.reached - self.recorded.reached)


def reached(mark: Mark) -> None:
    mark.done, mark.reached = True, next(_clock)


class StreamContext:
    """``torch.cuda.stream(s)`` as torch/cuda/__init__.py's StreamContext runs it: entering
    sets ``s`` as the current stream of its device (``set_stream``, which makes that device
    current: cudaSetDevice); leaving restores the previous stream of ``s``'s device, then the
    previous current stream, and with it (``set_stream`` again) the previous current device."""

    def __init__(self, gpu: Gpu, stream: Stream | None) -> None:
        self.gpu, self.stream = gpu, stream

    def __enter__(self) -> None:
        if self.stream is None:
            return
        self.src_prev = self.gpu.current_stream()
        if self.src_prev.device_index != self.stream.device_index:
            with self.gpu.device_guard(self.stream.device_index):
                self.dst_prev = self.gpu.current_stream(self.stream.device_index)
        self.gpu.set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        if self.stream is None:
            return
        if self.src_prev.device_index != self.stream.device_index:
            self.gpu.set_stream(self.dst_prev)
        self.gpu.set_stream(self.src_prev)
