"""The ring: shared-memory slots that workers collate straight into.

Each slot is an anonymous ``memfd`` mapping. It has no name in ``/dev/shm``, so a killed
process can never leave one behind, and Docker's small default ``/dev/shm`` does not limit it.
The main process owns the ring (one per loader, kept across epochs); workers receive each
slot's file descriptor over a control pipe and map it once.

Ownership (DESIGN.md invariant 2). A slot has exactly one owner at a time, and only the
ring decides when it may be reused::

    FREE ──acquire()──> ASSIGNED(ticket) ──lease(ticket)──> LEASED ──last view dies──> FREE
                              └────────release(ticket)──────────────────────────────────┘
    (a worker's private slot) ──adopt(fd)──────────────────> LEASED

``acquire`` hands out a :class:`Ticket` (slot id + generation). The task that holds it either
turns it into a lease (the batch arrived) or releases it (the task failed or was cancelled),
once. A task sent without a slot (before the ring knows the batch size, or when every slot is
out) has its worker write the batch into a slot of its own (:meth:`Arena.private`); the ring
adopts it on arrival, already leased to that batch, or maps it once for that batch alone.

A ticket of an older generation is stale: using it changes nothing, and raises
:class:`SlotOwnershipError` when ``FASTFEED_STRICT_RING=1`` (the test suite sets it), so a path
that releases twice can never free a slot another task owns.

A lease is a fresh numpy view of the slot. Every tensor of a delivered batch is a view of it,
so the slot returns only when nothing references the batch any more. A copy that the ring
cannot see (the GPU reading the slot on a stream) is declared with :meth:`SlotRing.fence`:
the slot is not handed out again until every fence on it reports completion, whatever path
dropped the batch. When every slot is out, tasks are sent without one and their private slots
die with their batches, as torch's shared memory would: nothing is ever overwritten, and the
ring stays bounded by ``max_slots × slot_bytes``.
"""

from __future__ import annotations

import collections
import enum
import logging
import mmap
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import DupFd, recv_handle, send_handle
from typing import Any, Protocol

import numpy as np
import torch

from fastfeed._proc import available_memory
from fastfeed.pinning import Pinner

__all__ = [
    "Arena",
    "Fence",
    "SlotOwnershipError",
    "SlotRing",
    "Ticket",
    "WorkerSlots",
    "ring_supported",
]

logger = logging.getLogger(__name__)

ALIGN = 64
# Variable-size batches (detection targets, ragged tensors) vary around the first size seen.
_HEADROOM = 1.25
# The ring may take at most this share of the memory the kernel reports as available.
_MAX_SHARE_OF_AVAILABLE = 0.5
# Misuse of a ticket is a bug in fastfeed: loud in tests, harmless (and logged) otherwise.
STRICT = os.environ.get("FASTFEED_STRICT_RING") == "1"


class SlotOwnershipError(RuntimeError):
    """A ticket was used after its slot changed hands (a double release, a stale lease)."""


class Fence(Protocol):
    """What :meth:`SlotRing.fence` needs of an event: ``torch.cuda.Event`` is one."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class Ticket:
    """The right to one use of a slot: the slot, and which of its hand-outs this is."""

    slot_id: int
    generation: int


class _State(enum.Enum):
    FREE = "free"
    ASSIGNED = "assigned"  # a task's worker may be writing it
    LEASED = "leased"  # views of it are alive in the main process


def ring_supported() -> bool:
    """Return whether this platform can build a ring (Linux ``memfd_create``)."""
    return hasattr(os, "memfd_create")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _new_memfd(name: str, nbytes: int) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map(fd: int, nbytes: int, populate: bool = False) -> mmap.mmap:
    """Map a slot. ``populate`` (workers, which write every slot sooner or later) maps all
    of its pages now, in one call, instead of a page fault per 4 KiB page on first write: for
    a 38.5 MB slot another process wrote, 3-4 ms instead of 14-18 ms; for fresh pages, 23-29
    instead of 30-36. The main process only reads slots (if the consumer touches the batch at
    all) and maps lazily: populating there stalled the consumer while the ring grew.
    """
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    # Before Python 3.13, mmap keeps a dup of the fd while the mapping lives.
    options = {"trackfd": False} if sys.version_info >= (3, 13) else {}
    return mmap.mmap(fd, nbytes, flags=flags, **options)


@dataclass(eq=False)
class _Slot:
    slot_id: int
    nbytes: int
    fd: int
    memory: np.ndarray  # uint8 view of the whole mapping; leases are views of it
    pinned: bool
    state: _State = _State.FREE
    generation: int = 0
    fences: list[Fence] = field(default_factory=list)

    @property
    def address(self) -> int:
        return int(self.memory.ctypes.data)

    def copies_done(self) -> bool:
        """Drop the fences that completed; True when none is left."""
        self.fences = [fence for fence in self.fences if not fence.query()]
        return not self.fences

    def reusable(self) -> bool:
        return self.state is _State.FREE and self.copies_done()


def _close_slots(slots: dict[int, _Slot]) -> None:
    """Close every slot, after the copies still reading any of them (shutdown only: the
    mapping of a slot nothing leases goes with it, and a copy engine may still read it)."""
    for slot in slots.values():
        for fence in slot.fences:
            fence.synchronize()
        slot.fences.clear()
        os.close(slot.fd)
    slots.clear()


class SlotRing:
    """The main process's side of the ring.

    Args:
        max_slots: the most slots the ring holds; beyond that, batches take the ordinary path.
        pin: page-locks each new slot for the CUDA device batches are copied to (see
            :mod:`fastfeed.pinning`); ``None`` leaves slots pageable.
        slot_bytes: initial slot size; 0 means "learn it from the first batches".
    """

    def __init__(self, max_slots: int, pin: Pinner | None = None, slot_bytes: int = 0) -> None:
        self.max_slots = max_slots
        self.pin = pin
        self.slot_bytes = _round_up(slot_bytes, mmap.PAGESIZE)
        self._slots: dict[int, _Slot] = {}
        self._next_id = 0
        # Leases die in whatever thread the garbage collector runs, possibly inside acquire()
        # on this very thread: their finalisers only append here (atomic), never lock.
        self._returned: collections.deque[tuple[int, int]] = collections.deque()
        self._lock = threading.Lock()
        self._warned_memory = False
        self._seen: int | None = None
        self._varies = False
        self._closer = weakref.finalize(self, _close_slots, self._slots)
        self._closer.atexit = False

    # -- sizing ------------------------------------------------------------------------------
    def note_required(self, nbytes: int) -> None:
        """Record that a batch needed ``nbytes`` of slot space; new slots will fit it.

        Fixed-size batches get slots of exactly their size. Once sizes are seen to vary
        (detection targets, ragged leaves), slots grow with headroom, so that they are not
        outgrown (and replaced) at every new maximum.
        """
        self._varies |= self._seen is not None and nbytes != self._seen
        self._seen = nbytes
        if nbytes > self.slot_bytes:
            headroom = _HEADROOM if self._varies else 1.0
            self.slot_bytes = _round_up(int(nbytes * headroom), mmap.PAGESIZE)

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory the ring holds now."""
        with self._lock:
            return sum(s.nbytes for s in self._slots.values())

    @property
    def occupancy(self) -> tuple[int, int]:
        """``(slots not reusable now, slots allocated)``."""
        with self._lock:
            self._collect_returned()
            return sum(not s.reusable() for s in self._slots.values()), len(self._slots)

    # -- slot life cycle ---------------------------------------------------------------------
    def acquire(self) -> tuple[Ticket | None, list[_Slot], list[int]]:
        """Take a reusable slot for a task.

        Returns ``(ticket, created, retired)``: the ticket (``None`` when the ring is exhausted
        or has not learned the batch size yet), slots newly created that workers must map, and
        ids of slots dropped because they are smaller than batches now need.
        """
        if self.slot_bytes == 0:
            return None, [], []
        created: list[_Slot] = []
        retired: list[int] = []
        with self._lock:
            self._collect_returned()
            slot = None
            for candidate in self._slots.values():
                if not candidate.reusable():
                    continue
                if candidate.nbytes < self.slot_bytes:
                    retired.append(candidate.slot_id)
                    continue
                slot = candidate
                break
            for slot_id in retired:
                self._drop(slot_id)
            if slot is None and len(self._slots) < self.max_slots and self._fits_in_memory():
                slot = self._create(self.slot_bytes)
                created.append(slot)
            if slot is None:
                return None, created, retired
            slot.state = _State.ASSIGNED
            slot.generation += 1
            return Ticket(slot.slot_id, slot.generation), created, retired

    def release(self, ticket: Ticket) -> None:
        """Give back an assigned slot whose task will never deliver (failed, cancelled)."""
        if not self._closer.alive:
            # Closed (the collector may finalise the ring before a shut-down pool hands its
            # tickets back): there is nothing left to give back to.
            return
        with self._lock:
            slot = self._owned(ticket, _State.ASSIGNED, "release")
            if slot is not None:
                slot.state = _State.FREE

    def lease(self, ticket: Ticket) -> np.ndarray:
        """Turn ``ticket`` into a view of its slot; the slot returns when the view dies."""
        with self._lock:
            slot = self._owned(ticket, _State.ASSIGNED, "lease")
            if slot is None:
                raise SlotOwnershipError(f"slot {ticket.slot_id} was reused before its batch "
                                         "was read")
            return self._lease(slot)

    def adopt(self, fd: int) -> tuple[np.ndarray, list[_Slot]]:
        """Lease the slot a worker made for a batch sent without a ticket (see
        :meth:`Arena.private`); ``fd`` is owned from now on.

        The ring keeps the slot for later tasks when it has room and the slot fits the batches
        it expects: the worker has already faulted its pages in, so a short first epoch leaves
        the ring grown, not an empty ring that the next epoch must grow (and fault in) again.
        Otherwise the lease is a one-off mapping, freed when the batch dies, as torch's shared
        memory would be. Returns ``(lease, created)``; workers must map the slots in ``created``.
        """
        try:
            nbytes = os.fstat(fd).st_size
            with self._lock:
                self._collect_returned()
                if (self._closer.alive and 0 < self.slot_bytes <= nbytes
                        and len(self._slots) < self.max_slots and self._fits_in_memory()):
                    owned, fd = fd, -1  # the slot's from here on, even if installing fails
                    slot = self._install(owned, nbytes)
                    slot.generation += 1
                    return self._lease(slot), [slot]
            return np.frombuffer(_map(fd, nbytes), dtype=np.uint8), []
        finally:
            if fd >= 0:
                os.close(fd)  # a one-off mapping holds its memory; nothing else needs the fd

    def _lease(self, slot: _Slot) -> np.ndarray:
        # Under the lock, so that nothing sees the slot between hand-out and lease.
        slot.state = _State.LEASED
        lease = slot.memory.view()
        weakref.finalize(lease, self._returned.append,
                         (slot.slot_id, slot.generation)).atexit = False
        return lease

    def fence(self, address: int, fence: Fence) -> bool:
        """Keep the slot holding ``address`` from reuse until ``fence.query()`` is True.

        Returns whether ``address`` lies in a slot of this ring.
        """
        with self._lock:
            for slot in self._slots.values():
                if slot.address <= address < slot.address + slot.nbytes:
                    slot.fences.append(fence)
                    return True
        return False

    def close(self) -> None:
        """Drop every slot (after the copies still reading them). Memory still leased to user
        batches stays valid until they die."""
        with self._lock:
            self._closer()

    def fds(self) -> list[tuple[int, int, int]]:
        """``(slot_id, nbytes, fd)`` of every live slot, for a worker that starts late."""
        with self._lock:
            return [(s.slot_id, s.nbytes, s.fd) for s in self._slots.values()]

    def _owned(self, ticket: Ticket, state: _State, action: str) -> _Slot | None:
        """The ticket's slot if the ticket still owns it in ``state``; else report misuse."""
        slot = self._slots.get(ticket.slot_id)
        if slot is not None and slot.generation == ticket.generation and slot.state is state:
            return slot
        now = "gone" if slot is None else f"{slot.state.value}, generation {slot.generation}"
        message = (f"ring: {action} of slot {ticket.slot_id} with a stale ticket (generation "
                   f"{ticket.generation}; the slot is {now})")
        if STRICT:
            raise SlotOwnershipError(message)
        logger.error(message)
        return None

    def _collect_returned(self) -> None:
        while self._returned:
            slot_id, generation = self._returned.popleft()
            slot = self._slots.get(slot_id)
            if slot is not None and slot.generation == generation:
                slot.state = _State.FREE

    def _create(self, nbytes: int) -> _Slot:
        return self._install(_new_memfd(f"fastfeed-slot-{self._next_id}", nbytes), nbytes)

    def _install(self, fd: int, nbytes: int) -> _Slot:
        """Make the memory behind ``fd`` (owned from now on) the ring's next slot."""
        try:
            memory = np.frombuffer(_map(fd, nbytes), dtype=np.uint8)
            pinned = self.pin is not None and self.pin.register(memory)
        except BaseException:
            os.close(fd)
            raise
        slot = _Slot(self._next_id, nbytes, fd, memory, pinned)
        self._slots[slot.slot_id] = slot
        self._next_id += 1
        logger.debug("ring: created slot %d of %d bytes (pinned: %s)", slot.slot_id, nbytes,
                     pinned)
        return slot

    def _drop(self, slot_id: int) -> None:
        # Only reusable slots are dropped: no lease, no copy still reading them.
        os.close(self._slots.pop(slot_id).fd)

    def _fits_in_memory(self) -> bool:
        available = available_memory()
        if available is None or self.slot_bytes <= _MAX_SHARE_OF_AVAILABLE * available:
            return True
        if not self._warned_memory:
            self._warned_memory = True
            warnings.warn(
                f"fastfeed: a {self.slot_bytes / 2**20:.0f} MiB ring slot does not fit in the "
                f"{available / 2**20:.0f} MiB of available memory; batches take torch's "
                "ordinary shared-memory path instead. Lower batch_size or prefetch_factor.",
                RuntimeWarning,
                stacklevel=2,
            )
        return False

    def __getstate__(self) -> dict:
        # Slots are process-local mappings; a pickled loader starts with an empty ring.
        return {"max_slots": self.max_slots, "pin": self.pin, "slot_bytes": self.slot_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)  # type: ignore[misc]


class WorkerSlots:
    """A worker's mappings of the ring's slots, kept in step over the control pipe."""

    def __init__(self, control: Connection) -> None:
        self._control = control
        self._buffers: dict[int, torch.Tensor] = {}
        self._largest_batch = 0

    def arena(self, slot_id: int | None) -> Arena:
        """Where a task's batch goes: its ring slot; without one, a private slot as large as
        the largest batch so far; for the first batch, a counting arena (the codec then
        sizes a private slot from the collated batch). Slots added or dropped since the last
        task are applied first."""
        self.sync()
        if slot_id is not None:
            return Arena(slot_id, self.buffer(slot_id))
        if self._largest_batch:
            return Arena.private(self._largest_batch)
        return Arena()

    def note_required(self, nbytes: int) -> None:
        """Record the bytes a batch needed, to size the private slots of later ones."""
        self._largest_batch = max(self._largest_batch, nbytes)

    @staticmethod
    def announce(control: Connection, pid: int, slot_id: int, nbytes: int, fd: int) -> None:
        """Main-process side: hand a new slot to the worker behind ``control``."""
        control.send(("add", slot_id, nbytes))
        send_handle(control, fd, pid)

    @staticmethod
    def retire(control: Connection, slot_id: int) -> None:
        """Main-process side: tell the worker to unmap a slot."""
        control.send(("drop", slot_id))

    def buffer(self, slot_id: int) -> torch.Tensor:
        """The uint8 tensor over slot ``slot_id``, mapping it first if it is new."""
        while slot_id not in self._buffers:
            self._handle(self._control.recv())
        return self._buffers[slot_id]

    def sync(self) -> None:
        """Apply every pending add or drop without blocking."""
        while self._control.poll():
            self._handle(self._control.recv())

    def _handle(self, message: tuple) -> None:
        if message[0] == "add":
            _, slot_id, nbytes = message
            fd = recv_handle(self._control)
            try:
                self._buffers[slot_id] = torch.frombuffer(_map(fd, nbytes, populate=True),
                                                          dtype=torch.uint8)
            finally:
                os.close(fd)
        else:
            self._buffers.pop(message[1], None)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * dtype.itemsize


class Arena:
    """A bump allocator over one slot, for the tensors of one batch.

    An arena without a buffer allocates nothing but still counts the bytes a batch needs, so
    the first batches, sent before the ring knows the batch size, teach it.
    """

    def __init__(self, slot_id: int | None = None, buffer: torch.Tensor | None = None) -> None:
        self.slot_id = slot_id
        self.buffer = buffer
        self.used = 0
        self.overflow = 0
        self._memfd: weakref.finalize | None = None

    @classmethod
    def private(cls, nbytes: int) -> Arena:
        """An arena over a new slot of the worker's own, for a task sent without a ticket.

        :meth:`hand_over` passes it to the main process, which adopts it into the ring
        (:meth:`SlotRing.adopt`). Its file descriptor closes with the arena if it never leaves.
        """
        nbytes = _round_up(nbytes, mmap.PAGESIZE)
        fd = _new_memfd("fastfeed-worker-slot", nbytes)
        try:
            buffer = torch.frombuffer(_map(fd, nbytes, populate=True), dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            raise
        arena = cls(None, buffer)
        arena._memfd = weakref.finalize(arena, os.close, fd)
        return arena

    def hand_over(self) -> Any:
        """A picklable handle on a private slot's memory (``None`` for others), which the main
        process redeems once with ``.detach()``; this arena's descriptor closes."""
        detached = None if self._memfd is None else self._memfd.detach()
        if detached is None:
            return None
        fd = detached[2][0]
        try:
            return DupFd(fd)  # a duplicate, served to the main process on request
        finally:
            os.close(fd)

    @property
    def required(self) -> int:
        """Bytes this batch needs to fit in a slot."""
        return self.used + self.overflow

    def allocate(self, nbytes: int) -> int | None:
        """Reserve ``nbytes``; return the byte offset, or None (and count it) if it won't fit."""
        start = _round_up(self.used, ALIGN)
        if self.buffer is None or start + nbytes > self.buffer.numel():
            self.overflow += _round_up(nbytes, ALIGN)
            return None
        self.used = start + nbytes
        return start

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A contiguous tensor in the slot, or None if the slot has no room."""
        nbytes = _nbytes(shape, dtype)
        offset = self.allocate(nbytes)
        if offset is None:
            return None
        assert self.buffer is not None
        return self.buffer[offset : offset + nbytes].view(dtype).view(shape)

    def empty_or_new(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor in the slot if it has room, else an ordinary one."""
        tensor = self.empty(shape, dtype)
        if tensor is not None:
            return tensor
        # Not counted twice: the codec counts this tensor when it finds no room to copy it.
        self.overflow -= _round_up(_nbytes(shape, dtype), ALIGN)
        return torch.empty(shape, dtype=dtype)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in this arena's slot."""
        return (
            self.buffer is not None
            and tensor.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()
        )
