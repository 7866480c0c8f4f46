"""Landing a batch that came back from a Ray actor: from the object store into the task's pool
slot, copied once and rebuilt over the copy (or finished there by a batch tail), on one core.

No remote process maps the slot pool: this process writes every slot a Ray worker's batch goes
to, once the pool has turned the task's ticket into the batch's lease.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from fastfeed.backends.ray.wire import unship
from fastfeed.collate import Empty, torch_empty
from fastfeed.protocol import Shipped
from fastfeed.slots import Arena, Lease
from fastfeed.slots.memory import ALIGN, round_up
from fastfeed.tree import map_tensors

__all__ = ["Landing"]


@functools.cache
def _thread_counts_are_per_thread() -> bool:
    """Whether ``torch.set_num_threads`` sets the calling thread's count alone: with OpenMP,
    ATen's parallel backend in torch's Linux builds (torch's pin-memory thread relies on it)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


@contextlib.contextmanager
def _on_one_core() -> Iterator[None]:
    """torch's ops in this thread run on one core meanwhile. Landing a batch is memory-bound
    work beside workers that keep the cores busy: split across the cores, each part waits for
    a core to come free, and the whole costs several times the CPU (on two busy cores, a float
    tail took 30 ms of CPU on two threads, 6.5 ms on one). Other threads keep their count; one
    whose first parallel op falls inside a landing starts with one thread, as torch gives a new
    thread the count last set (its own pin-memory thread leaves every later thread on one)."""
    if not _thread_counts_are_per_thread():
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class _Allocator:
    """An ``empty`` that remembers the storages it handed out."""

    def __init__(self, empty: Empty) -> None:
        self._empty = empty
        self.made: set[int] = set()

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        tensor = self._empty(shape, dtype)
        self.made.add(tensor.untyped_storage().data_ptr())
        return tensor


class Landing:
    """Where Ray workers' batches land: the task's slot (its lease's memory), or, for a task
    sent without one, memory of this process's own, freed with the batch.

    Args:
        tail: ``tail(batch, empty)`` finishes each batch as it lands, writing its output with
            the slot's allocator: the workers then ship a dataset's short items (uint8
            images: a quarter of float32's bytes through the object store), and the float
            batch is written into the slot where a copy would have been
            (:mod:`fastfeed.tail_split`).
    """

    def __init__(self, tail: Callable[[Any, Empty], Any] | None = None) -> None:
        self._tail = tail
        self._finished_bytes = 0  # what the tail's last batch took in a slot

    def required(self, shipped: Shipped) -> int:
        """The bytes ``shipped`` takes in a slot once landed; with a tail, what its last batch
        took (0 before the first: that one lands in memory of its own)."""
        return shipped.required if self._tail is None else self._finished_bytes

    def land(self, shipped: Shipped, lease: Lease | None) -> Any:
        """The batch, in ``lease``'s memory (else in memory of its own), its views recorded in
        the lease: copied once from the object store and rebuilt over the copy, or finished
        from the object store by the tail."""
        with _on_one_core():
            if self._tail is None:
                return self._copied(shipped, lease)
            return self._finished(self._tail, shipped, lease)

    def _copied(self, shipped: Shipped, lease: Lease | None) -> Any:
        memory = (torch.empty(shipped.required, dtype=torch.uint8).numpy() if lease is None
                  else lease.memory)
        regions = []
        end = 0
        for buffer in shipped.buffers:
            raw = np.frombuffer(buffer, dtype=np.uint8)
            start = round_up(end, ALIGN)
            end = start + raw.nbytes
            memory[start:end] = raw
            regions.append(memory.data[start:end])
        batch, views = unship(shipped, regions)
        if lease is not None:
            lease.views = views
        return batch

    def _finished(self, tail: Callable[[Any, Empty], Any], shipped: Shipped,
                  lease: Lease | None) -> Any:
        empty = _Allocator(torch_empty if lease is None
                           else Arena(None, torch.from_numpy(lease.memory)).empty)
        batch = tail(unship(shipped)[0], empty)

        tensors: list[torch.Tensor] = []

        def own(tensor: torch.Tensor) -> torch.Tensor:
            # What the tail passed through still lies in the object store: copy it out.
            if tensor.untyped_storage().data_ptr() not in empty.made:
                tensor = empty(tuple(tensor.shape), tensor.dtype).copy_(tensor)
            tensors.append(tensor)
            return tensor

        batch = map_tensors(own, batch)
        self._finished_bytes = sum(round_up(t.nbytes, ALIGN) for t in tensors)
        if lease is not None:
            lease.views = tuple(tensors)
        return batch
