"""Landing a batch that came back from a Ray actor: from the object store into the task's pool
slot, copied once (or finished there by a batch tail), on one core.

No remote process maps the slot pool: this process writes every slot a Ray worker's batch goes
to, while the task holds the slot's ticket.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from fastfeed.backends.ray.wire import unship
from fastfeed.codec import decode, encode, slot_bytes_needed
from fastfeed.collate import Empty, torch_empty
from fastfeed.protocol import Encoded, Shipped
from fastfeed.slots import Arena, Lease, SlotPool

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


class _PrivateSlot:
    """A slot of this process's own, for a task sent without one: the slot pool adopts its
    descriptor (``detach()``), as it adopts a worker process's slot, or it closes with its
    arena."""

    def __init__(self, nbytes: int) -> None:
        self._memfd = Arena.private(nbytes)
        # The batch is written through a plain arena over the same memory: encode() hands a
        # private arena's descriptor to another process, and this one stays here.
        self.arena = Arena(None, self._memfd.buffer)

    def detach(self) -> int:
        fd = self._memfd.detach_private_slot()
        assert fd is not None, "a private slot is adopted once"
        return fd


class Landing:
    """Where Ray workers' batches land.

    Args:
        slot_pool: the loader's (None: each batch lands in memory of its own).
        tail: ``tail(batch, empty)`` finishes each batch as it lands, writing its output with
            the slot's allocator: the workers then ship a dataset's short items (uint8
            images: a quarter of float32's bytes through the object store), and the float
            batch is written into the slot where a copy would have been
            (:mod:`fastfeed.tail_split`).
    """

    def __init__(self, slot_pool: SlotPool | None,
                 tail: Callable[[Any, Empty], Any] | None = None) -> None:
        self._slot_pool = slot_pool
        self._tail = tail

    def land(self, shipped: Shipped, slot_id: int | None) -> Encoded | Any:
        """The batch, copied once from the object store, or finished from there by the
        tail: into the task's pool slot, or into a slot of this process's own for a task sent
        without one (the slot pool adopts it); without a slot pool, into memory of its own."""
        with _on_one_core():
            return self._land(shipped, slot_id)

    def _land(self, shipped: Shipped, slot_id: int | None) -> Encoded | Any:
        batch = unship(shipped)
        tail = self._tail
        if self._slot_pool is None:  # the shipped batch copied out, then finished
            buffer = torch.empty(shipped.nbytes, dtype=torch.uint8)
            batch = decode(encode(batch, Arena(None, buffer)), Lease(buffer.numpy()))
            return batch if tail is None else tail(batch, torch_empty)
        if slot_id is not None:
            memory: np.ndarray = self._slot_pool.assigned_memory(slot_id)
            arena = Arena(slot_id, torch.from_numpy(memory))
            return encode(batch if tail is None else tail(batch, arena.empty), arena)
        nbytes = shipped.nbytes
        if tail is not None:  # the finished batch's size is known once it is made
            batch = tail(batch, torch_empty)
            nbytes = slot_bytes_needed(batch)
        slot = _PrivateSlot(nbytes)
        return replace(encode(batch, slot.arena), private_slot=slot)
