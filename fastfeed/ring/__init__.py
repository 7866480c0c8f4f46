"""The ring: shared-memory slots that workers collate straight into.

Two sides, two modules: :mod:`fastfeed.ring.slots` runs in the main process (which slot is
whose, leases, fences, sizing, adoption); :mod:`fastfeed.ring.arena` runs in a worker (its
mappings of the slots, and the allocator a batch is written with). Both map slots as
:mod:`fastfeed.ring.memory` makes them.
"""

from fastfeed.ring.arena import Arena, WorkerSlots
from fastfeed.ring.memory import ring_supported
from fastfeed.ring.slots import (
    Fence,
    Lease,
    SlotOwnershipError,
    SlotRing,
    Ticket,
    slot_budget,
)

__all__ = ["Arena", "Fence", "Lease", "SlotOwnershipError", "SlotRing", "Ticket", "WorkerSlots",
           "ring_supported", "slot_budget"]
