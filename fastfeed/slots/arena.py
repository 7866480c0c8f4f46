"""The worker's side of the slot pool: how it reaches the slots, and the arena a batch is
written into.

A worker process (:class:`WorkerSlots`) hears of each slot over its control pipe
(:class:`~fastfeed.slots.control.ControlPipe`: :class:`SlotAdded` with the file descriptor,
:class:`SlotDropped`), maps each slot once and reuses the mapping for every batch it writes
there. A worker thread (:class:`ThreadSlots`) asks the slot pool itself.
"""

from __future__ import annotations

import mmap
import os
import weakref
from multiprocessing.reduction import DupFd
from typing import TYPE_CHECKING

import torch

from fastfeed.protocol import PrivateSlot, SlotAdded, SlotDropped
from fastfeed.slots.control import ControlPipe
from fastfeed.slots.memory import ALIGN, map_slot, new_memfd, round_up

if TYPE_CHECKING:
    from fastfeed.slots.pool import SlotPool

__all__ = ["Arena", "ThreadSlots", "WorkerSlots"]


class WorkerSlots:
    """A worker process's mappings of the pool's slots, kept in step over the control pipe.
    Its batches cross to the main process encoded (:func:`fastfeed.codec.encode`)."""

    in_this_process = False

    def __init__(self, control: ControlPipe) -> None:
        self._control = control
        self._buffers: dict[int, torch.Tensor] = {}
        self._largest_batch = 0  # bytes: the size of the slots this worker makes itself

    def arena(self, slot_id: int | None) -> Arena:
        """Where a task's batch goes: its pool slot; without one, a slot of the worker's own
        as large as the largest batch so far; for the first batch, a counting arena (the codec
        then sizes a slot of the worker's own from the collated batch). Slots added or dropped
        since the last task are applied first."""
        self._apply_pending()
        if slot_id is not None:
            return Arena(slot_id, self._buffer(slot_id))
        if self._largest_batch:
            return Arena.private(self._largest_batch)
        return Arena()

    def written(self, nbytes: int) -> None:
        """A batch needed ``nbytes``: the slots this worker makes itself will fit it."""
        self._largest_batch = max(self._largest_batch, nbytes)

    def close(self) -> None:
        self._control.close()

    def _buffer(self, slot_id: int) -> torch.Tensor:
        """The uint8 tensor over slot ``slot_id``, mapping it first if it is new."""
        while slot_id not in self._buffers:
            self._apply(self._control.receive())
        return self._buffers[slot_id]

    def _apply_pending(self) -> None:
        while self._control.poll():
            self._apply(self._control.receive())

    def _apply(self, message: SlotAdded | SlotDropped) -> None:
        if isinstance(message, SlotAdded):
            try:
                self._buffers[message.slot_id] = torch.frombuffer(
                    map_slot(message.fd, message.nbytes, populate=True), dtype=torch.uint8)
            finally:
                os.close(message.fd)
        else:
            self._buffers.pop(message.slot_id, None)


class ThreadSlots:
    """A worker thread's way to the pool's slots: the slot pool itself, which this process
    holds. Its batches are handed over as it made them (:class:`~fastfeed.protocol.InPlace`)."""

    in_this_process = True

    def __init__(self, slot_pool: SlotPool) -> None:
        self._slot_pool = slot_pool

    def arena(self, slot_id: int | None) -> Arena:
        """Where a task's batch goes: its pool slot, through the memory its lease will be on
        (:meth:`~fastfeed.slots.SlotPool.writer`); without one, ordinary memory, counted."""
        if slot_id is None:
            return Arena()
        memory = self._slot_pool.writer(slot_id)
        return Arena(slot_id, torch.frombuffer(memory.data, dtype=torch.uint8))

    def written(self, nbytes: int) -> None:
        pass  # a thread makes no slot of its own to size

    def close(self) -> None:
        pass


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * dtype.itemsize


class Arena:
    """A bump allocator over one slot, for the arrays of one batch.

    An arena without a buffer allocates nothing but still counts the bytes a batch needs, so
    the first batches, sent before the slot pool knows the batch size, teach it.
    """

    def __init__(self, slot_id: int | None = None, buffer: torch.Tensor | None = None) -> None:
        self.slot_id = slot_id
        self.buffer = buffer
        self.used = 0
        self.overflow = 0
        self.outside = 0  # bytes empty() made outside the slot, aligned as if in it
        self._memfd: weakref.finalize | None = None

    @classmethod
    def private(cls, nbytes: int) -> Arena:
        """An arena over a new slot of the worker's own, for a task sent without a ticket.

        :meth:`export_private_slot` passes it to the main process, which adopts it into the pool
        (:meth:`fastfeed.slots.SlotPool.adopt`). Its file descriptor closes with the arena if
        it never leaves.
        """
        nbytes = round_up(nbytes, mmap.PAGESIZE)
        fd = new_memfd("fastfeed-worker-slot", nbytes)
        try:
            buffer = torch.frombuffer(map_slot(fd, nbytes, populate=True), dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            raise
        arena = cls(None, buffer)
        arena._memfd = weakref.finalize(arena, os.close, fd)
        return arena

    def detach_private_slot(self) -> int | None:
        """The file descriptor of a private slot (None for others), owned by the caller from
        now on: it no longer closes with this arena."""
        detached = None if self._memfd is None else self._memfd.detach()
        return None if detached is None else detached[2][0]

    def export_private_slot(self) -> PrivateSlot | None:
        """A picklable handle on a private slot's memory (``None`` for others), which the main
        process redeems once with ``.detach()``; this arena's descriptor closes."""
        fd = self.detach_private_slot()
        if fd is None:
            return None
        try:
            return DupFd(fd)  # a duplicate, served to the main process on request
        finally:
            os.close(fd)

    @property
    def required(self) -> int:
        """Bytes this batch needs to fit in a slot, once the codec has placed what did not."""
        return self.used + self.overflow

    @property
    def requested(self) -> int:
        """Bytes the ``empty`` tensors of a batch handed over as it was made need in a slot."""
        return round_up(self.used, ALIGN) + self.outside

    def allocate(self, nbytes: int) -> int | None:
        """Reserve ``nbytes``; return the byte offset, or None (and count it) if it won't fit."""
        start = round_up(self.used, ALIGN)
        if self.buffer is None or start + nbytes > self.buffer.numel():
            self.overflow += round_up(nbytes, ALIGN)
            return None
        self.used = start + nbytes
        return start

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor in the slot if it has room, else an ordinary one (which the
        codec counts, and sends by torch's own path, when it finds no room to copy it)."""
        nbytes = _nbytes(shape, dtype)
        offset = self.allocate(nbytes)
        if offset is None:
            self.overflow -= round_up(nbytes, ALIGN)  # the codec counts it as it places it
            self.outside += round_up(nbytes, ALIGN)
            return torch.empty(shape, dtype=dtype)
        assert self.buffer is not None
        return self.buffer[offset : offset + nbytes].view(dtype).view(shape)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in this arena's slot."""
        return (
            self.buffer is not None
            and tensor.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()
        )
