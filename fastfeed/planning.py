"""Each epoch's plan, decided in one place before anything runs: what happens to a batch
from the sampler to the consumer.

A FastLoader asks its :class:`Planner` for one :class:`EpochPlan` as each epoch starts
(``iter(loader)``). The plan is frozen and complete; the host iterator and the device stage
only carry it out:

* the host side (:class:`~fastfeed.iterators.HostPlan`): which backend runs the workers
  (``worker_mode="auto"``: one epoch each of its contest, then the fastest), the slot pool they
  collate into and whether its slots are page-locked, what the workers read and collate with (a
  dataset's batch tail, :mod:`fastfeed.tail_split`), the tuner, and the batches the device
  stage holds (they size the slot pool);
* the device side (:class:`~fastfeed.device.StagePlan`): the device the batches are delivered
  on, or batches pinned ahead of the consumer, or nothing; what runs there.

What one host iterator leaves to the next (the slot pool, the tuner, the contest's rates, a
state to resume from) the planner keeps across epochs. Persistent workers carry on with the
host plan they started with: the next epoch's plan repeats it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from fastfeed._torch_compat import auto_collation, is_iterable_dataset
from fastfeed.autotune import WorkerTuner
from fastfeed.backends import AUTO, BackendArgs, WorkerBackend, backends_for
from fastfeed.device import DeviceStage, StagePlan, chain
from fastfeed.iterators import CarryOver, HostPlan
from fastfeed.shared_lists import ListsCache
from fastfeed.slots import SlotPool, slots_supported
from fastfeed.slots.page_lock import PageLocker
from fastfeed.tail_split import TailPlan, batch_tail_split, plan_tail
from fastfeed.telemetry import Telemetry

__all__ = ["PINNED_AHEAD", "EpochPlan", "LoaderOptions", "Planner"]

# Batches pinned ahead of the consumer with pin_memory=True and no device: the pool's tasks in
# flight are the read-ahead; a pinned copy takes milliseconds, so two cover a step that asks
# for its batch early (see fastfeed.device.pinned).
PINNED_AHEAD = 2


@dataclass(frozen=True)
class LoaderOptions:
    """FastLoader's own arguments, as a plan reads them (see :class:`fastfeed.FastLoader`).

    Attributes:
        device: the checked ``device`` (a bare ``"cuda"`` is resolved at the first plan).
        placement: where the workers go, as the backend checked ``ray_options``.
        autotune: ``num_workers="auto"``; ``max_workers`` is then the tuner's bound.
    """

    device: torch.device | None = None
    prefetch_depth: int = 2
    gpu_transform: Callable[[Any], Any] | None = None
    worker_mode: str = "process"
    placement: dict[str, Any] | None = None
    ring_slots: int | None = None
    deterministic: bool = False
    autotune: bool = False
    max_workers: int = 0
    share_lists: bool = True


@dataclass(frozen=True)
class EpochPlan:
    """One epoch, planned once before its host iterator is made.

    Attributes:
        host: what the host iterator does (a new one's, or the running persistent one's).
        stage: what the device stage does with the host iterator's batches.
    """

    host: HostPlan
    stage: StagePlan


class Planner:
    """A loader's planning: one :class:`EpochPlan` per epoch, and what carries from one host
    iterator to the next. One per loader, never copied with it.

    Args:
        telemetry: the loader's.
        stage: the loader's device stage, which resolves the device once.
    """

    def __init__(self, telemetry: Telemetry, stage: DeviceStage) -> None:
        self.telemetry = telemetry
        self.carry_over = CarryOver()
        self.slot_pool: SlotPool | None = None  # one per loader, made on first use
        self.lists = ListsCache()  # its last packing of the dataset's lists, kept for the next
        self._stage = stage
        self._decided_mode = False
        self._running: tuple[HostPlan, TailPlan] | None = None  # the last new host iterator's

    def plan(self, loader: DataLoader, options: LoaderOptions, new_host: bool = True
             ) -> EpochPlan:
        """The plan of ``loader``'s next epoch, run by a new host iterator, or (``new_host``
        False) by the running persistent one, whose host plan is kept."""
        target = self._stage.target(options.device)
        copy_device = self._stage.cuda_index()
        pinned_ahead = None  # pin_memory() needs CUDA
        if target is None and loader.pin_memory and torch.cuda.is_available():
            pinned_ahead = PINNED_AHEAD if loader.num_workers else 0  # 0: as torch, in next()
        if new_host or self._running is None:
            self._running = self._host(loader, options, copy_device, pinned_ahead)
        host, tail = self._running
        stage = StagePlan(
            target=target, pinned_ahead=pinned_ahead,
            transform=chain(tail.device_tail, options.gpu_transform),
            gpu_transform=options.gpu_transform, prefetch_depth=options.prefetch_depth,
            auto_collation=auto_collation(loader),
            watches_gpu=copy_device is not None or (
                loader.pin_memory and torch.cuda.is_available()))
        return EpochPlan(host, stage)

    def _host(self, loader: DataLoader, options: LoaderOptions, copy_device: int | None,
              pinned_ahead: int | None) -> tuple[HostPlan, TailPlan]:
        """A new host iterator's plan, and where it runs a dataset's batch tail."""
        if options.device is not None:  # the ready batches, and the one being copied
            held, timed = options.prefetch_depth + 1, True
        elif pinned_ahead is not None:
            held, timed = (1 if pinned_ahead else 0), True
        else:
            held, timed = 0, False
        backend = slot_pool = None
        if loader.num_workers > 0:
            backend = self._backend(loader, options)
            slot_pool = self._slot_pool(backend, options.ring_slots, copy_device)
        split = batch_tail_split(loader.dataset, loader.collate_fn, auto_collation(loader))
        tail = plan_tail(split, on_device=options.device is not None,
                         lands_batches=backend is not None and backend.traits.lands_batches)
        host = HostPlan(
            telemetry=self.telemetry,
            carry_over=self.carry_over,
            dataset=loader.dataset if tail.dataset is None else tail.dataset,
            collate_fn=loader.collate_fn if tail.collate_fn is None else tail.collate_fn,
            deterministic=options.deterministic,
            backend=backend,
            backend_args=BackendArgs(slot_pool, loader.multiprocessing_context,
                                     options.placement, tail.landing_tail,
                                     self.lists if options.share_lists else None),
            tuner=self._tuner(loader, options),
            slot_cap=options.ring_slots,
            held_batches=held,
            times_delivery=timed,
        )
        return host, tail

    def _tuner(self, loader: DataLoader, options: LoaderOptions) -> WorkerTuner | None:
        """``num_workers="auto"``'s tuner, one per loader, restarted from the loader's count.
        None for an IterableDataset, whose replicas shard by worker count: it stays fixed."""
        if not options.autotune or is_iterable_dataset(loader.dataset):
            return None
        tuner = self.carry_over.tuner or WorkerTuner(loader.num_workers, options.max_workers)
        tuner.restart(loader.num_workers)
        self.carry_over.tuner = tuner
        return tuner

    def _backend(self, loader: DataLoader, options: LoaderOptions) -> type[WorkerBackend]:
        """``worker_mode``'s backend; ``"auto"`` tries each of its contest for an epoch, then
        keeps the fastest (persistent workers keep the first)."""
        contest = backends_for(options.worker_mode, loader.dataset, options.deterministic)
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
        """The loader's slot pool, made on first use and kept across epochs (page-locking is
        slow and synchronising). Its slots are page-locked only when fastfeed owns every copy
        out of them (``device="cuda"``): a slot the user copies from must not be
        (docs/design.md, invariant 2). Worker threads then write none: their batches are
        handed over as made, so nothing records which of their tensors view the slot, and the
        device stage could not refuse one whose views its copy does not reach."""
        if not backend.traits.uses_slot_pool or ring_slots == 0 or not slots_supported():
            return None
        if backend.traits.in_this_process and copy_device is not None:
            return None
        if self.slot_pool is None or self.slot_pool.sealed:  # a sealed one has no descriptors
            locker = None if copy_device is None else PageLocker(copy_device)
            self.slot_pool = SlotPool(max_slots=0, pin=locker)
        return self.slot_pool
