"""The device stage, assembled in one place: what wraps a loader's host iterator.

A loader has one :class:`DeviceStage`, made with it and kept across epochs. Each epoch starts
from one :class:`EpochPlan`, made once by :meth:`DeviceStage.plan` from the loader's arguments
(:class:`StageOptions`) before the host iterator exists: what the host iterator gives (its
:class:`~fastfeed.iterators.setup.HostPlan`) and what the stage then does with its batches,
which :meth:`DeviceStage.wrap` builds:

* no ``device``: the host iterator itself; with ``pin_memory=True`` (and CUDA), a
  :class:`~fastfeed.device.pinned.PinnedIterator` that copies its batches into torch's pinned
  memory, ahead of the consumer on a helper thread (in ``next()`` with ``num_workers=0``);
* ``device="cpu"``: a :class:`~fastfeed.device.prefetch.DeviceIterator` with a
  :class:`~fastfeed.device.copiers.HostCopier`;
* ``device="cuda"``: the same with a :class:`~fastfeed.device.copiers.StreamCopier` on the
  process's copy stream for that GPU (:mod:`~fastfeed.device.own_streams`: none of torch's
  pool, which libraries share), its slots page-locked for that GPU.

The transforms run on the device in order: the tail of what the workers make (a dataset's
batch tail, as the plan placed it), then ``gpu_transform``, seeded from the iterator's base
seed. The stage also keeps the NVML sampler that reads the GPU the batches go to.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fastfeed.device.copiers import Copier, HostCopier, StreamCopier
from fastfeed.device.own_streams import own_stream
from fastfeed.device.pinned import PinHelper, PinnedIterator
from fastfeed.device.prefetch import DeviceIterator, HostIterator, TorchIteratorHost
from fastfeed.device.resolve import resolve_device
from fastfeed.iterators import BaseIterator
from fastfeed.iterators.setup import HostPlan, HostTerms
from fastfeed.tail_split import TailPlacement
from fastfeed.telemetry import GpuSampler, Telemetry

__all__ = ["PINNED_AHEAD", "DeviceStage", "EpochPlan", "StageOptions"]

# Batches pinned ahead of the consumer with pin_memory=True and no device: the pool's tasks in
# flight are the read-ahead; a pinned copy takes milliseconds, so two cover a step that asks
# for its batch early (see fastfeed.device.pinned).
PINNED_AHEAD = 2


@dataclass(frozen=True)
class StageOptions:
    """What the loader's arguments ask of the device stage.

    Attributes:
        device: the loader's checked ``device`` (a bare ``"cuda"`` is resolved at the first
            iteration), or None.
        pin_memory: the loader's ``pin_memory``.
        prefetch_depth: batches copied ahead of the consumer.
        gpu_transform: run on each batch on the device, after the copy.
        num_workers: the loader's (without workers, a batch is pinned in ``next()``).
        auto_collation: the loader batches samples itself (how delivered samples are counted).
    """

    device: torch.device | None
    pin_memory: bool = False
    prefetch_depth: int = 2
    gpu_transform: Callable[[Any], Any] | None = None
    num_workers: int = 0
    auto_collation: bool = True


@dataclass(frozen=True)
class EpochPlan:
    """One epoch, planned once before its host iterator is made.

    Attributes:
        host: what the host iterator gives (what the stage asks of it, and where a dataset's
            batch tail runs).
        target: the device the batches are delivered on (resolved), or None.
        pinned_ahead: without a device, with ``pin_memory=True`` and CUDA: the batches pinned
            ahead of the consumer (0: in ``next()``); None: no pinning.
        transform: run on each batch on the device, on the copy stream: the batch tail, then
            ``gpu_transform``.
        options: the loader's arguments the plan was made from.
    """

    host: HostPlan
    target: torch.device | None
    pinned_ahead: int | None
    transform: Callable[[Any], Any] | None
    options: StageOptions


class _Chain:
    """``then(first(batch))``, which blocks the host (and so runs on the device stage's helper
    thread, see :class:`~fastfeed.device.prefetch.DeviceIterator`) when either part does: a
    GPU decode tail followed by the user's ``gpu_transform`` must not move back onto the
    training thread."""

    def __init__(self, first: Callable[[Any], Any], then: Callable[[Any], Any]) -> None:
        self._first, self._then = first, then
        self.blocks_host = any(getattr(part, "blocks_host", False) for part in (first, then))

    def __call__(self, batch: Any) -> Any:
        return self._then(self._first(batch))

    def prepare(self, device: torch.device) -> None:
        """Each part's ``prepare``, where it has one (see DeviceIterator)."""
        for part in (self._first, self._then):
            if hasattr(part, "prepare"):
                part.prepare(device)


def _chain(first: Callable[[Any], Any] | None, then: Callable[[Any], Any] | None
           ) -> Callable[[Any], Any] | None:
    if first is None or then is None:
        return first or then
    return _Chain(first, then)


class DeviceStage:
    """One loader's device stage: the device it delivers to (resolved once), its copy stream
    and its GPU sampler, which every epoch's iterator shares.

    Args:
        telemetry: the loader's, which the stage's iterators report to.
    """

    def __init__(self, telemetry: Telemetry) -> None:
        self._telemetry = telemetry
        self._target: torch.device | None = None  # the device, resolved at first use
        self.copy_stream: Any = None  # the process's for the device, taken on first use
        self._gpu_sampler: GpuSampler | None = None
        self._pin_helper: PinHelper | None = None  # the last pinned iterator's

    def target(self, device: torch.device | None) -> torch.device | None:
        """``device``, resolved the first time it is asked for (at the first iteration, once
        the training script has chosen its GPU), then kept."""
        if device is not None and self._target is None:
            self._target = resolve_device(device)
        return self._target

    def plan(self, options: StageOptions, tail: TailPlacement) -> EpochPlan:
        """The next epoch's plan, with a dataset's batch tail placed as ``tail`` says."""
        target = self.target(options.device)
        pinned_ahead = self._pinned_ahead(options)
        if target is not None:  # ready batches, plus the one being copied
            terms = HostTerms(self._cuda_index(), held_batches=options.prefetch_depth + 1,
                              times_delivery=True)
        elif pinned_ahead is not None:
            terms = HostTerms(held_batches=1 if pinned_ahead else 0, times_delivery=True)
        else:
            terms = HostTerms()
        return EpochPlan(HostPlan(terms, tail), target, pinned_ahead,
                         _chain(tail.device_tail, options.gpu_transform), options)

    def _pinned_ahead(self, options: StageOptions) -> int | None:
        """With ``pin_memory=True`` and no ``device``, how many batches are pinned ahead of
        the consumer (0: in ``next()``, as torch does without workers); None: no pinning
        (``pin_memory()`` needs CUDA)."""
        if options.device is not None or not options.pin_memory or not torch.cuda.is_available():
            return None
        return PINNED_AHEAD if options.num_workers else 0

    def release_host(self) -> None:
        """Let the host iterator go: the last pinned iterator's helper stops reading it (it
        leaves after the batch it is pulling), before persistent workers start their next
        epoch on it. Its batches pinned ahead are dropped."""
        if self._pin_helper is not None:
            self._pin_helper.leave()
            self._pin_helper = None

    def gpu_sampler(self) -> GpuSampler:
        """The sampler of the GPU the batches go to (the current device when fastfeed copies
        nothing), made on first use."""
        if self._gpu_sampler is None:
            self._gpu_sampler = GpuSampler(self._cuda_index())
        return self._gpu_sampler

    def _cuda_index(self) -> int | None:
        """The CUDA device the batches go to (resolved); None for another device, or none."""
        target = self._target
        return target.index if target is not None and target.type == "cuda" else None

    def wrap(self, host: Any, plan: EpochPlan) -> Any:
        """What the consumer iterates for ``host`` (a FastLoader iterator, or torch's for a
        DataPipe), as ``plan`` says."""
        target, options = plan.target, plan.options
        heads_to_cuda = (target is not None and target.type == "cuda") or (
            options.pin_memory and torch.cuda.is_available())
        if heads_to_cuda and self._gpu_sampler is None:
            sampler = self.gpu_sampler()
            sampler.start()
            weakref.finalize(self, sampler.stop)
        if target is None:
            # torch's own iterators (DataPipes) pin their batches themselves.
            if plan.pinned_ahead is None or not isinstance(host, BaseIterator):
                return host
            pinned = PinnedIterator(host, plan.pinned_ahead, self._telemetry,
                                    options.auto_collation)
            self._pin_helper = pinned.helper
            return pinned
        source: HostIterator = host if isinstance(host, BaseIterator) else TorchIteratorHost(host)
        gpu_transform = options.gpu_transform
        if gpu_transform is not None and hasattr(gpu_transform, "seed"):
            # Seeded from the base seed the iterator already drew: no extra generator draws.
            gpu_transform.seed(source.base_seed)
        copier: Copier = HostCopier(target)
        if target.type == "cuda":
            if self.copy_stream is None:  # the process's, never one of torch's pool
                self.copy_stream = own_stream(target, "copy")
            copier = StreamCopier(target, self.copy_stream)
        return DeviceIterator(source, copier, options.prefetch_depth, plan.transform,
                              self._telemetry, options.auto_collation)
