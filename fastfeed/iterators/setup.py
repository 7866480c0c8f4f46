"""What a FastLoader hands its iterators, beyond torch's ``DataLoader`` attributes.

The loader computes an :class:`IteratorSetup` for every new iterator; iterators read torch's
attributes from the loader and everything fastfeed-specific from the setup, and never reach
back into ``FastLoader``: the dependency runs one way, loader to iterators.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastfeed.autotune import WorkerTuner
from fastfeed.backends import WorkerKind
from fastfeed.resume import LoaderState
from fastfeed.ring import SlotRing
from fastfeed.tail import TailPlacement
from fastfeed.telemetry import Telemetry

__all__ = ["CarryOver", "IteratorSetup"]


@dataclass
class CarryOver:
    """What a loader carries from one iterator to the next: what the last one learned, and a
    state to resume from. Owned by the loader; holds no reference to it, so an iterator
    keeping it makes no cycle."""

    epoch_rates: dict[str, float] = field(default_factory=dict)  # first epoch, per worker mode
    workers: int | None = None  # where the tuner settled
    tuner: WorkerTuner | None = None  # one per loader: its bounds hold across epochs
    resume: LoaderState | None = None  # from load_state_dict, for the next epoch to start

    def take_resume(self) -> LoaderState | None:
        resume, self.resume = self.resume, None
        return resume


@dataclass
class IteratorSetup:
    """The loader's decisions for one iterator."""

    telemetry: Telemetry
    carry_over: CarryOver
    worker_mode: WorkerKind = "process"  # "auto" is resolved first
    ray_options: dict[str, Any] | None = None  # where Ray actors go (worker_mode="ray")
    tuner: WorkerTuner | None = None
    ring: SlotRing | None = None  # the loader's ring, for process workers
    pin_batches: bool = False  # pin_memory=True: copy batches into torch's pinned memory
    held_by_prefetch: int = 0  # host batches a device prefetcher holds on to
    ring_slots: int | None = None
    deterministic: bool = False
    # False when a device stage wraps the iterator: it measures the consumer's wait itself.
    record_delivery: bool = True
    # Where a dataset whose tail runs on whole batches has it run (see fastfeed.tail): what the
    # workers read and collate with, and what finishes their batches (same batches).
    tail: TailPlacement = field(default_factory=TailPlacement)
