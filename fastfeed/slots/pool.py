"""The main process's side of the slot pool: slots, who owns each, and when one may be reused.

The main process owns the slot pool (one per loader, kept across epochs). A slot has exactly one
owner at a time, and only the slot pool changes it (docs/design.md, invariant 2)::

    FREE ──acquire()──> ASSIGNED(ticket) ──lease(ticket)──> LEASED ──last view dies──> FREE
                              └────────release(ticket)──────────────────────────────────┘
    (a worker's own slot) ──adopt(fd)──────────────────────> LEASED

``acquire`` hands out a :class:`Ticket` (slot id + generation). The task that holds it either
turns it into a :class:`Lease` (the batch arrived) or releases it (the task failed or was
cancelled), once. A task sent without a slot (before the slot pool knows the batch size, or when
every slot is out) has its worker write the batch into a slot of its own; the slot pool adopts it
on arrival, already leased to that batch, or maps it once for that batch alone.

A ticket of an older generation is stale: using it changes nothing, and raises
:class:`SlotOwnershipError` when ``FASTFEED_STRICT_SLOTS=1`` (the test suite sets it), so a path
that releases twice can never free a slot another task owns.

Every array of a delivered batch is a view of its lease's memory, so the slot returns only
when nothing references the batch any more. (A worker thread's batch is handed over as it
was made, not rebuilt: it writes through :meth:`SlotPool.writer`, the memory its lease will
be on.) A reader the slot pool cannot see (the GPU copying the slot on a stream) is declared
with :meth:`Lease.fence`: the slot is not handed out again until every fence on it reports
completion, whatever path dropped the batch.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import threading
import warnings
import weakref
from collections.abc import Collection

import numpy as np

from fastfeed import inherited_fds
from fastfeed._proc import available_memory
from fastfeed.protocol import SlotAdded
from fastfeed.slots.memory import map_slot, new_memfd, round_up
from fastfeed.slots.page_lock import PageLocker
from fastfeed.slots.slot import (
    Fence,
    Slot,
    SlotOwnershipError,
    SlotState,
    Ticket,
    close_slots,
)

__all__ = ["Fence", "Lease", "SlotOwnershipError", "SlotPool", "Ticket", "slot_budget"]

logger = logging.getLogger(__name__)

# Variable-size batches (detection targets, ragged tensors) vary around the first size seen.
_HEADROOM = 1.25
# The slot pool may take at most this share of the memory the kernel reports as available.
_MAX_SHARE_OF_AVAILABLE = 0.5
# Beyond the slots of in-flight tasks: the batch being decoded and the one the user still holds.
_SPARE_SLOTS = 2
# Misuse of a ticket is a bug in fastfeed: loud in tests, harmless (and logged) otherwise.
# FASTFEED_STRICT_RING is the variable's former name, still read.
STRICT = "1" in (os.environ.get("FASTFEED_STRICT_SLOTS"), os.environ.get("FASTFEED_STRICT_RING"))


def slot_budget(tasks_in_flight: int, held_by_prefetch: int = 0,
                ring_slots: int | None = None) -> int:
    """How many slots a slot pool may hold: ``ring_slots`` when the user fixed it, else one for
    every task in flight, the batch being decoded, the one the training loop still holds, and
    the batches a device prefetcher holds."""
    if ring_slots is not None:
        return ring_slots
    return tasks_in_flight + _SPARE_SLOTS + held_by_prefetch


class Lease:
    """One batch's hold on a slot.

    ``memory`` is a uint8 view of the slot; every array of the batch views it, and the slot
    returns to the slot pool when the last of those views dies. ``views`` are the tensors and arrays
    of the batch that the codec rebuilt over it (:func:`fastfeed.codec.decode` records them): a
    reader that must see every view of a page-locked slot (the device stage) checks it did. A
    lease on memory outside the pool (a worker's slot the pool could not keep) has nothing to
    fence: that memory is never page-locked, so a copy from it is staged before the call returns.
    """

    __slots__ = ("_slot", "_slot_pool", "memory", "views")

    def __init__(self, memory: np.ndarray, slot_pool: SlotPool | None = None,
                 slot: Slot | None = None) -> None:
        self.memory = memory
        self._slot_pool = slot_pool
        self._slot = slot
        self.views: tuple[object, ...] = ()

    def fence(self, fence: Fence) -> None:
        """Keep the slot from reuse until ``fence.query()`` is True."""
        if self._slot_pool is not None and self._slot is not None:
            self._slot_pool._fence(self._slot, fence)


class SlotPool:
    """The main process's side of the slot pool.

    Args:
        max_slots: the most slots the slot pool holds (see :func:`slot_budget`); beyond that,
            batches take the ordinary path.
        pin: page-locks each new slot for the CUDA device batches are copied to (see
            :mod:`fastfeed.slots.page_lock`); ``None`` leaves slots pageable.
        slot_bytes: initial slot size; 0 means "learn it from the first batches".
    """

    def __init__(self, max_slots: int, pin: PageLocker | None = None, slot_bytes: int = 0) -> None:
        self.max_slots = max_slots
        self.pin = pin
        self.slot_bytes = round_up(slot_bytes, mmap.PAGESIZE)
        self._slots: dict[int, Slot] = {}
        self._next_id = 0
        # Leases die in whatever thread the garbage collector runs, possibly inside acquire()
        # on this very thread: their finalisers only append here (atomic), never lock.
        self._returned: collections.deque[tuple[int, int]] = collections.deque()
        self._lock = threading.Lock()
        self._warned_memory = False
        self._seen: int | None = None
        self._varies = False
        self._closer = weakref.finalize(self, close_slots, self._slots)
        self._closer.atexit = False
        self.sealed = False  # no new worker will map these slots (see seal)
        inherited_fds.register(self)

    # -- sizing ------------------------------------------------------------------------------
    def fit_batches_of(self, nbytes: int) -> None:
        """Make new slots fit a batch that needed ``nbytes``.

        Fixed-size batches get slots of exactly their size. Once sizes are seen to vary
        (detection targets, ragged leaves), slots grow with headroom, so that they are not
        outgrown (and replaced) at every new maximum.
        """
        self._varies |= self._seen is not None and nbytes != self._seen
        self._seen = nbytes
        if nbytes > self.slot_bytes:
            headroom = _HEADROOM if self._varies else 1.0
            self.slot_bytes = round_up(int(nbytes * headroom), mmap.PAGESIZE)

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory the slot pool holds now."""
        with self._lock:
            return sum(s.nbytes for s in self._slots.values())

    @property
    def occupancy(self) -> tuple[int, int]:
        """``(slots not reusable now, slots allocated)``."""
        with self._lock:
            self._collect_returned()
            return sum(not s.reusable() for s in self._slots.values()), len(self._slots)

    # -- slot life cycle ---------------------------------------------------------------------
    def acquire(self) -> tuple[Ticket | None, list[SlotAdded], list[int]]:
        """Take a reusable slot for a task.

        Returns ``(ticket, created, retired)``: the ticket (``None`` when the slot pool is exhausted
        or has not learned the batch size yet), slots newly created that workers must map, and
        ids of slots dropped because they are smaller than batches now need.
        """
        if self.slot_bytes == 0:
            return None, [], []
        created: list[SlotAdded] = []
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
                created.append(slot.added())
            if slot is None:
                return None, created, retired
            slot.state = SlotState.ASSIGNED
            slot.generation += 1
            return Ticket(slot.slot_id, slot.generation), created, retired

    def release(self, ticket: Ticket) -> None:
        """Give back an assigned slot whose task will never deliver (failed, cancelled)."""
        if not self._closer.alive:
            # Closed (the collector may finalise the slot pool before a shut-down pool hands its
            # tickets back): there is nothing left to give back to.
            return
        with self._lock:
            slot = self._owned(ticket, SlotState.ASSIGNED, "release")
            if slot is not None:
                slot.state = SlotState.FREE
                slot.writer = None

    def writer(self, slot_id: int) -> np.ndarray:
        """The memory a worker in this process writes the batch of the task holding slot
        ``slot_id`` through: the lease that task's ticket becomes is on this very view, so
        that the batch's tensors, made over it, hold the slot as a rebuilt batch's views do.

        Raises:
            SlotOwnershipError: no task holds the slot.
        """
        with self._lock:
            slot = self._slots.get(slot_id)
            if slot is None or slot.state is not SlotState.ASSIGNED:
                raise SlotOwnershipError(f"slot {slot_id} is written by no task")
            slot.writer = slot.memory.view()
            return slot.writer

    def lease(self, ticket: Ticket) -> Lease:
        """Turn ``ticket`` into its batch's lease; the slot returns when the views die."""
        with self._lock:
            slot = self._owned(ticket, SlotState.ASSIGNED, "lease")
            if slot is None:
                raise SlotOwnershipError(f"slot {ticket.slot_id} was reused before its batch "
                                         "was read")
            return self._lease(slot)

    def adopt(self, fd: int) -> tuple[Lease, list[SlotAdded]]:
        """Lease the slot a worker made for a batch sent without a ticket (see
        :meth:`fastfeed.slots.Arena.private`); ``fd`` is owned from now on.

        The slot pool keeps the slot for later tasks when it has room and the slot fits the batches
        it expects: the worker has already faulted its pages in, so a short first epoch leaves
        the pool grown, not an empty pool that the next epoch must grow (and fault in) again.
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
                    return self._lease(slot), [slot.added()]
            return Lease(np.frombuffer(map_slot(fd, nbytes), dtype=np.uint8)), []
        finally:
            if fd >= 0:
                os.close(fd)  # a one-off mapping holds its memory; nothing else needs the fd

    def _lease(self, slot: Slot) -> Lease:
        # Under the lock, so that nothing sees the slot between hand-out and lease.
        slot.state = SlotState.LEASED
        memory = slot.memory.view() if slot.writer is None else slot.writer
        slot.writer = None
        weakref.finalize(memory, self._returned.append,
                         (slot.slot_id, slot.generation)).atexit = False
        return Lease(memory, self, slot)

    def _fence(self, slot: Slot, fence: Fence) -> None:
        with self._lock:
            slot.fences.append(fence)

    def close(self) -> None:
        """Drop every slot (after the copies still reading them). Memory still leased to user
        batches stays valid until they die."""
        with self._lock:
            self._closer()

    def seal(self) -> None:
        """No worker will start with this slot pool any more (persistent workers that the tuner
        does not grow): keep no descriptor for the slots, only their mappings, and close each
        new slot's once :meth:`announced`. The workers hold the slots, not their descriptors,
        so the main process then holds no more descriptors than the stock loader's."""
        with self._lock:
            self.sealed = True
            for slot in self._slots.values():
                slot.close_fd()

    def release_inherited(self, keep: Collection[object]) -> None:
        """In a forked worker, which maps the slots it is sent: close every slot's descriptor
        (see :mod:`fastfeed.inherited_fds`)."""
        for slot in list(self._slots.values()):
            slot.close_fd()

    def announced(self, created: list[SlotAdded]) -> None:
        """Every worker was told of the ``created`` slots: a sealed pool closes their
        descriptors."""
        if self.sealed and created:
            with self._lock:
                for added in created:
                    slot = self._slots.get(added.slot_id)
                    if slot is not None:
                        slot.close_fd()

    def slots(self) -> list[SlotAdded]:
        """Every live slot, for a worker that starts late."""
        with self._lock:
            return [s.added() for s in self._slots.values()]

    def _owned(self, ticket: Ticket, state: SlotState, action: str) -> Slot | None:
        """The ticket's slot if the ticket still owns it in ``state``; else report misuse."""
        slot = self._slots.get(ticket.slot_id)
        if slot is not None and slot.generation == ticket.generation and slot.state is state:
            return slot
        now = "gone" if slot is None else f"{slot.state.value}, generation {slot.generation}"
        message = (f"slot pool: {action} of slot {ticket.slot_id} with a stale ticket (generation "
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
                slot.state = SlotState.FREE

    def _create(self, nbytes: int) -> Slot:
        return self._install(new_memfd(f"fastfeed-slot-{self._next_id}", nbytes), nbytes)

    def _install(self, fd: int, nbytes: int) -> Slot:
        """Make the memory behind ``fd`` (owned from now on) the slot pool's next slot."""
        try:
            memory = np.frombuffer(map_slot(fd, nbytes), dtype=np.uint8)
            page_locked = self.pin is not None and self.pin.register(memory)
        except BaseException:
            os.close(fd)
            raise
        slot = Slot(self._next_id, nbytes, fd, memory, page_locked)
        self._slots[slot.slot_id] = slot
        self._next_id += 1
        logger.debug("slot pool: created slot %d of %d bytes (page-locked: %s)", slot.slot_id,
                     nbytes, page_locked)
        return slot

    def _drop(self, slot_id: int) -> None:
        # Only reusable slots are dropped: no lease, no copy still reading them.
        self._slots.pop(slot_id).close_fd()

    def _fits_in_memory(self) -> bool:
        available = available_memory()
        if available is None or self.slot_bytes <= _MAX_SHARE_OF_AVAILABLE * available:
            return True
        if not self._warned_memory:
            self._warned_memory = True
            warnings.warn(
                f"fastfeed: a {self.slot_bytes / 2**20:.0f} MiB pool slot does not fit in the "
                f"{available / 2**20:.0f} MiB of available memory; batches take torch's "
                "ordinary shared-memory path instead. Lower batch_size or prefetch_factor.",
                RuntimeWarning,
                stacklevel=2,
            )
        return False

    def __getstate__(self) -> dict:
        # Slots are process-local mappings; a pickled loader starts with an empty slot pool.
        return {"max_slots": self.max_slots, "pin": self.pin, "slot_bytes": self.slot_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)  # type: ignore[misc]

