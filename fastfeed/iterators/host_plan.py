"""What a host iterator is told: its part of the epoch's plan, and what the loader carries
from one host iterator to the next.

Every field of a :class:`HostPlan` is decided before the iterator exists, in one place
(:mod:`fastfeed.planning`); the iterator carries it out, reading torch's own attributes
(``batch_size``, ``sampler``, ``timeout`` ...) from the loader and fastfeed's from the plan. It
never reaches back into ``FastLoader``: the dependency runs one way, loader to iterators.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastfeed.autotune import WorkerTuner
from fastfeed.backends import BackendArgs, WorkerBackend
from fastfeed.resume import LoaderState
from fastfeed.slots import SlotPool
from fastfeed.telemetry import Telemetry

__all__ = ["CarryOver", "HostPlan"]


@dataclass
class CarryOver:
    """What a loader carries from one host iterator to the next: what the last one learned,
    and a state to resume from. Owned by the loader's planner; holds no reference to the
    loader, so an iterator keeping it makes no cycle."""

    epoch_rates: dict[str, float] = field(default_factory=dict)  # first epoch, per worker mode
    workers: int | None = None  # where the tuner settled
    tuner: WorkerTuner | None = None  # one per loader: its bounds hold across epochs
    resume: LoaderState | None = None  # from load_state_dict, for the next epoch to start

    def take_resume(self) -> LoaderState | None:
        resume, self.resume = self.resume, None
        return resume


@dataclass(frozen=True)
class HostPlan:
    """One host iterator's part of an epoch's plan.

    Attributes:
        telemetry: the loader's, which the iterator reports to.
        carry_over: the loader's; the iterator takes its resume state and leaves what it
            learned (the epoch's rate, the tuner's worker count).
        dataset: what the workers read: the loader's dataset, or its batch tail split's
            (:mod:`fastfeed.tail_split`), whose items stop early.
        collate_fn: what the workers collate with: the loader's, or the split's.
        deterministic: the workers reseed before every sample.
        backend: runs the workers (with ``worker_mode="auto"``: this epoch's of the contest);
            None without workers.
        backend_args: what the backend is built with: the slot pool (None: no slot pool), the
            multiprocessing context, where the workers go, the split's tail where this
            process runs it as it lands a batch, and whether the workers share lists.
        tuner: ``num_workers="auto"``'s, or None.
        slot_cap: the most slots the slot pool may hold (the loader's ``ring_slots``); None:
            sized to the tasks in flight and ``held_batches``.
        held_batches: host batches the device stage holds at once; their slots stay out of
            the slot pool.
        times_delivery: the device stage measures the consumer's wait itself.
    """

    telemetry: Telemetry
    carry_over: CarryOver
    dataset: Any
    collate_fn: Callable[[Any], Any]
    deterministic: bool = False
    backend: type[WorkerBackend] | None = None
    backend_args: BackendArgs = field(default_factory=BackendArgs)
    tuner: WorkerTuner | None = None
    slot_cap: int | None = None
    held_batches: int = 0
    times_delivery: bool = False

    @property
    def slot_pool(self) -> SlotPool | None:
        """The loader's slot pool, for a backend that uses one."""
        return self.backend_args.slot_pool
