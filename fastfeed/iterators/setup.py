"""What a FastLoader hands its iterators, beyond torch's ``DataLoader`` attributes, and where
that is decided.

The loader's :class:`IteratorPlanner` computes an :class:`IteratorSetup` for every new
iterator, from the loader's own arguments (:class:`PoolOptions`): the worker mode (``"auto"``'s
contest), the slot pool and whether its slots are page-locked, the tuner, where a batch tail runs.
Iterators read torch's attributes from the loader and everything fastfeed-specific from the
setup, and never reach back into ``FastLoader``: the dependency runs one way, loader to
iterators.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from torch.utils.data import DataLoader

from fastfeed._torch_compat import auto_collation, is_iterable_dataset
from fastfeed.autotune import WorkerTuner
from fastfeed.backends import WorkerKind
from fastfeed.resume import LoaderState
from fastfeed.slots import SlotPool, slots_supported
from fastfeed.slots.page_lock import Pinner
from fastfeed.tail_split import TailPlacement, batch_tail_split, place_tail
from fastfeed.telemetry import Telemetry

__all__ = ["CarryOver", "HostTerms", "IteratorPlanner", "IteratorSetup", "PoolOptions"]


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
    slot_pool: SlotPool | None = None  # the loader's slot pool, for process workers
    ring_slots: int | None = None
    deterministic: bool = False
    share_lists: bool = True  # process workers read the dataset's large lists from one copy
    terms: HostTerms = field(default_factory=HostTerms)  # the device stage's, if any
    # Where a dataset whose tail runs on whole batches has it run (fastfeed.tail_split): what the
    # workers read and collate with, and what finishes their batches (same batches).
    tail: TailPlacement = field(default_factory=TailPlacement)


@dataclass(frozen=True)
class PoolOptions:
    """FastLoader's own arguments that shape its iterators (see :class:`fastfeed.FastLoader`).

    Attributes:
        worker_mode: ``"process"``, ``"thread"``, ``"ray"`` or ``"auto"``.
        max_workers: with ``autotune``, the most workers the tuner may start.
        on_device: a ``device`` was given: batches are finished on it.
        terms: what the device stage asks of the iterator.
    """

    worker_mode: str = "process"
    ray_options: dict[str, Any] | None = None
    ring_slots: int | None = None
    deterministic: bool = False
    autotune: bool = False
    max_workers: int = 0
    on_device: bool = False
    share_lists: bool = True
    terms: HostTerms = field(default_factory=HostTerms)


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

    def setup(self, loader: DataLoader, options: PoolOptions) -> IteratorSetup:
        """Everything fastfeed decides for ``loader``'s next iterator."""
        # Replicas of an IterableDataset shard by worker count: keep it fixed.
        tuner = None
        if options.autotune and not is_iterable_dataset(loader.dataset):
            tuner = self.carry_over.tuner or WorkerTuner(loader.num_workers, options.max_workers)
            tuner.restart(loader.num_workers)
            self.carry_over.tuner = tuner
        worker_mode = self._worker_mode(loader, options)
        split = batch_tail_split(loader.dataset, loader.collate_fn, auto_collation(loader))
        return IteratorSetup(
            telemetry=self.telemetry,
            carry_over=self.carry_over,
            worker_mode=worker_mode,
            ray_options=options.ray_options,
            tuner=tuner,
            slot_pool=self._slot_pool(worker_mode, options.ring_slots, options.terms.copy_device),
            ring_slots=options.ring_slots,
            deterministic=options.deterministic,
            share_lists=options.share_lists,
            terms=options.terms,
            tail=place_tail(split, on_device=options.on_device, worker_mode=worker_mode),
        )

    def _worker_mode(self, loader: DataLoader, options: PoolOptions) -> WorkerKind:
        """``"auto"`` tries each mode for an epoch, then keeps the faster one."""
        if options.worker_mode != "auto":
            return cast(WorkerKind, options.worker_mode)  # checked by check_arguments
        if (is_iterable_dataset(loader.dataset) or options.deterministic
                or loader.persistent_workers):
            return "process"
        rates = self.carry_over.epoch_rates
        modes: tuple[WorkerKind, ...] = ("process", "thread")
        for mode in modes:
            if mode not in rates:
                return mode
        chosen = max(modes, key=lambda mode: rates[mode])
        if not self._decided_mode:
            self._decided_mode = True
            self.telemetry.decision("worker_mode auto: " + ", ".join(
                f"{m} {r:,.1f} batches/s" for m, r in rates.items()) + f" -> {chosen}")
        return chosen

    def _slot_pool(self, worker_mode: WorkerKind, ring_slots: int | None, copy_device: int | None
              ) -> SlotPool | None:
        """The loader's slot pool, made on first use and kept across epochs (page-locking is slow
        and synchronising). Its slots are page-locked only when fastfeed owns every copy out
        of them (``device="cuda"``): a slot the user copies from must not be (invariant 2)."""
        if worker_mode not in ("process", "ray") or ring_slots == 0 or not slots_supported():
            return None
        if self.slot_pool is None or self.slot_pool.sealed:  # a sealed one has no descriptors
            pin = None if copy_device is None else Pinner(copy_device)
            self.slot_pool = SlotPool(max_slots=0, pin=pin)
        return self.slot_pool
