"""The slot pool: shared-memory slots that workers collate straight into.

A pool, not a ring: a task takes whichever slot is free first, and a slot comes back when the
last view of its batch dies, in no fixed order (the loader's ``ring_slots`` argument keeps its
historical name and sizes this pool).

Two sides, two modules: :mod:`fastfeed.slots.pool` runs in the main process (which slot is
whose, leases, fences, sizing, adoption); :mod:`fastfeed.slots.arena` runs in a worker (its
mappings of the slots, and the allocator a batch is written with). Both map slots as
:mod:`fastfeed.slots.memory` makes them; :mod:`fastfeed.slots.page_lock` page-locks them for
a loader that copies them to its GPU itself.
"""

from fastfeed.slots.arena import Arena, ThreadSlots, WorkerSlots
from fastfeed.slots.memory import slots_supported
from fastfeed.slots.pool import (
    Fence,
    Lease,
    SlotOwnershipError,
    SlotPool,
    Ticket,
    slot_budget,
)

__all__ = [
    "Arena",
    "Fence",
    "Lease",
    "SlotOwnershipError",
    "SlotPool",
    "ThreadSlots",
    "Ticket",
    "WorkerSlots",
    "slot_budget",
    "slots_supported",
]
