"""What a FastLoader hands its iterators, beyond torch's ``DataLoader`` attributes, and where
that is decided.

Each epoch's plan (:class:`fastfeed.device.EpochPlan`) is made once, before its host iterator:
its :class:`HostPlan` says what the host iterator gives (the device stage's terms, and where a
dataset's batch tail runs: :meth:`IteratorPlanner.tail`). For every new iterator, the loader's
:class:`IteratorPlanner` then computes an :class:`IteratorSetup` from that host plan and the
loader's own arguments (:class:`PoolOptions`): the worker mode (``"auto"``'s contest), the slot
pool and whether its slots are page-locked, the tuner. Iterators read torch's attributes from
the loader and everything fastfeed-specific from the setup, and never reach back into
``FastLoader``: the dependency runs one way, loader to iterators.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import DataLoader

from fastfeed._torch_compat import auto_collation, is_iterable_dataset, persistent_iterator
from fastfeed.autotune import WorkerTuner
from fastfeed.backends import AUTO, WorkerBackend, backend_named, candidates
from fastfeed.resume import LoaderState
from fastfeed.shared_lists import ListsCache
from fastfeed.slots import SlotPool, slots_supported
from fastfeed.slots.page_lock import Pinner
from fastfeed.tail_split import TailPlacement, batch_tail_split, place_tail
from fastfeed.telemetry import Telemetry

__all__ = ["CarryOver", "HostPlan", "HostTerms", "IteratorPlanner", "IteratorSetup",
           "PoolOptions"]


@dataclass(frozen=True)
class HostTerms:
    """What the device stage asks of the host iterators it will wrap.

    Attributes:
        copy_device: the CUDA device fastfeed copies batches to itself (``device="cuda"``):
            it owns and fences every copy out of a slot, so slots may be page-locked for it.
            None otherwise.
        held_batches: host batches the stage holds at once; their slots stay out of the slot pool.
        times_delivery: the stage measures the consumer's wait itself.
    """

    copy_device: int | None = None
    held_batches: int = 0
    times_delivery: bool = False


@dataclass(frozen=True)
class HostPlan:
    """What one epoch's host iterator gives.

    Attributes:
        terms: what the device stage asks of it.
        tail: where a dataset's batch tail runs (see :mod:`fastfeed.tail_split`): what the
            workers read and collate with, and what finishes their batches.
    """

    terms: HostTerms = field(default_factory=HostTerms)
    tail: TailPlacement = field(default_factory=TailPlacement)


@dataclass
class CarryOver:
    """What a loader carries from one iterator to the next: what the last one learned, and a
    state to resume from. Owned by the loader; holds no reference to it, so an iterator
    keeping it makes no cycle."""

    epoch_rates: dict[str, float] = field(default_factory=dict)  # first epoch, per worker mode
    workers: int | None = None  # where the tuner settled
    tuner: WorkerTuner | None = None  # one per loader: its bounds hold across epochs
    resume: LoaderState | None = None  # from load_state_dict, for the next epoch to start
    lists: ListsCache = field(default_factory=ListsCache)  # the last packing of its lists

    def take_resume(self) -> LoaderState | None:
        resume, self.resume = self.resume, None
        return resume


@dataclass
class IteratorSetup:
    """The loader's decisions for one iterator."""

    telemetry: Telemetry
    carry_over: CarryOver
    backend: type[WorkerBackend] = field(default_factory=lambda: backend_named("process"))
    placement: dict[str, Any] | None = None  # where the workers go (worker_mode="ray")
    tuner: WorkerTuner | None = None
    slot_pool: SlotPool | None = None  # the loader's, for a backend that uses one
    ring_slots: int | None = None
    deterministic: bool = False
    host: HostPlan = field(default_factory=HostPlan)  # the epoch's, for this iterator
    share_lists: bool = True  # process workers read the dataset's large lists from one copy


@dataclass(frozen=True)
class PoolOptions:
    """FastLoader's own arguments that shape its iterators (see :class:`fastfeed.FastLoader`).

    Attributes:
        worker_mode: a backend's name, or ``"auto"``.
        placement: where the workers go, as the backend checked ``ray_options``.
        max_workers: with ``autotune``, the most workers the tuner may start.
    """

    worker_mode: str = "process"
    placement: dict[str, Any] | None = None
    ring_slots: int | None = None
    deterministic: bool = False
    autotune: bool = False
    max_workers: int = 0
    share_lists: bool = True


class IteratorPlanner:
    """A loader's side of its iterators: what one iterator leaves to the next (the slot pool, the
    tuner, the first epochs' rates, a state to resume from), and the decisions each new one
    starts from. One per loader, never copied with it.

    Args:
        telemetry: the loader's.
    """

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.carry_over = CarryOver()
        self.slot_pool: SlotPool | None = None  # one per loader, made on first use
        self._decided_mode = False
        self._host_tail = TailPlacement()  # the last new host iterator's

    def tail(self, loader: DataLoader, worker_mode: str, on_device: bool) -> TailPlacement:
        """Where the next epoch runs a dataset's batch tail: as the running persistent
        workers were set up to, else decided afresh for a new host iterator."""
        if loader.persistent_workers and persistent_iterator(loader) is not None:
            return self._host_tail
        split = batch_tail_split(loader.dataset, loader.collate_fn, auto_collation(loader))
        lands = loader.num_workers > 0 and any(
            b.traits.lands_batches for b in candidates(worker_mode))
        self._host_tail = place_tail(split, on_device=on_device, lands_batches=lands)
        return self._host_tail

    def setup(self, loader: DataLoader, options: PoolOptions, host: HostPlan) -> IteratorSetup:
        """Everything fastfeed decides for ``loader``'s next iterator, whose epoch plans
        ``host``."""
        # Replicas of an IterableDataset shard by worker count: keep it fixed.
        tuner = None
        if options.autotune and not is_iterable_dataset(loader.dataset):
            tuner = self.carry_over.tuner or WorkerTuner(loader.num_workers, options.max_workers)
            tuner.restart(loader.num_workers)
            self.carry_over.tuner = tuner
        backend = self._backend(loader, options)
        return IteratorSetup(
            telemetry=self.telemetry,
            carry_over=self.carry_over,
            backend=backend,
            placement=options.placement,
            tuner=tuner,
            slot_pool=self._slot_pool(backend, options.ring_slots, host.terms.copy_device),
            ring_slots=options.ring_slots,
            deterministic=options.deterministic,
            host=host,
            share_lists=options.share_lists,
        )

    def _backend(self, loader: DataLoader, options: PoolOptions) -> type[WorkerBackend]:
        """``worker_mode``'s backend; ``"auto"`` tries each of its contest for an epoch, then
        keeps the fastest (persistent workers keep the first)."""
        contest = candidates(options.worker_mode, loader.dataset, options.deterministic)
        if options.worker_mode != AUTO or loader.persistent_workers or len(contest) == 1:
            return contest[0]
        rates = self.carry_over.epoch_rates
        for backend in contest:
            if backend.name not in rates:
                return backend
        chosen = max(contest, key=lambda backend: rates[backend.name])
        if not self._decided_mode:
            self._decided_mode = True
            self.telemetry.decision("worker_mode auto: " + ", ".join(
                f"{m} {r:,.1f} batches/s" for m, r in rates.items()) + f" -> {chosen.name}")
        return chosen

    def _slot_pool(self, backend: type[WorkerBackend], ring_slots: int | None,
                   copy_device: int | None) -> SlotPool | None:
        """The loader's slot pool, made on first use and kept across epochs (page-locking is slow
        and synchronising). Its slots are page-locked only when fastfeed owns every copy out
        of them (``device="cuda"``): a slot the user copies from must not be
        (docs/design.md, invariant 2)."""
        if not backend.traits.uses_slot_pool or ring_slots == 0 or not slots_supported():
            return None
        if self.slot_pool is None or self.slot_pool.sealed:  # a sealed one has no descriptors
            pin = None if copy_device is None else Pinner(copy_device)
            self.slot_pool = SlotPool(max_slots=0, pin=pin)
        return self.slot_pool
