"""One slot of the pool, as the main process keeps it: its mapping and descriptor, its state
and generation, and the fences of the copies still reading it (see :mod:`fastfeed.slots.pool`,
which alone changes them)."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from fastfeed.protocol import SlotAdded

__all__ = ["Fence", "Slot", "SlotOwnershipError", "SlotState", "Ticket", "close_slots"]


class SlotOwnershipError(RuntimeError):
    """A ticket was used after its slot changed hands (a double release, a stale lease)."""


class Fence(Protocol):
    """What :meth:`Lease.fence` needs of an event: ``torch.cuda.Event`` is one."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class Ticket:
    """The right to one use of a slot: the slot, and which of its hand-outs this is."""

    slot_id: int
    generation: int


class SlotState(enum.Enum):
    FREE = "free"
    ASSIGNED = "assigned"  # a task's worker may be writing it
    LEASED = "leased"  # views of it are alive in the main process


@dataclass(eq=False)
class Slot:
    """A slot of the pool: ``memory`` maps its ``nbytes``; ``fd`` is its descriptor, or -1 once
    closed (a sealed pool's workers hold their own)."""

    slot_id: int
    nbytes: int
    fd: int
    memory: np.ndarray  # uint8 view of the whole mapping; leases are views of it
    page_locked: bool
    state: SlotState = SlotState.FREE
    generation: int = 0
    fences: list[Fence] = field(default_factory=list)
    writer: np.ndarray | None = None  # the view a worker thread writes its task's batch through

    @property
    def address(self) -> int:
        return int(self.memory.ctypes.data)

    def added(self) -> SlotAdded:
        """The message that tells a worker of this slot."""
        assert self.fd >= 0, "a sealed slot pool's slot cannot be announced again"
        return SlotAdded(self.slot_id, self.nbytes, self.fd)

    def close_fd(self) -> None:
        """Close the slot's descriptor (the mapping stays): once, whoever calls first."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def copies_done(self) -> bool:
        """Drop the fences that completed; True when none is left."""
        self.fences = [fence for fence in self.fences if not fence.query()]
        return not self.fences

    def reusable(self) -> bool:
        return self.state is SlotState.FREE and self.copies_done()


def close_slots(slots: dict[int, Slot]) -> None:
    """Close every slot, after the copies still reading any of them (shutdown only: the
    mapping of a slot nothing leases goes with it, and a copy engine may still read it)."""
    for slot in slots.values():
        for fence in slot.fences:
            fence.synchronize()
        slot.fences.clear()
        slot.close_fd()
    slots.clear()
