"""The device stage, assembled in one place: what wraps a loader's host iterator.

A loader has one :class:`DeviceStage`, made with it and kept across epochs: the device it
delivers to (resolved once), the copy stream and the GPU sampler. Each epoch's plan
(:mod:`fastfeed.planning`) says what the stage does that epoch (its :class:`StagePlan`), which
:meth:`DeviceStage.wrap` builds around the host iterator:

* no ``device``: the host iterator itself; with ``pin_memory=True`` (and CUDA), a
  :class:`~fastfeed.device.pinned.PinnedIterator` that copies its batches into torch's pinned
  memory, ahead of the consumer on a helper thread (in ``next()`` with ``num_workers=0``);
* ``device="cpu"``: a :class:`~fastfeed.device.prefetch.DeviceIterator` with a
  :class:`~fastfeed.device.copiers.CpuCopier`;
* ``device="cuda"``: the same with a :class:`~fastfeed.device.copiers.StreamCopier` on the
  process's copy stream for that GPU (:mod:`~fastfeed.device.own_streams`: none of torch's
  pool, which libraries share).

The plan's transform runs on the device, on the copy stream: the tail of what the workers make
(a dataset's batch tail, where the plan put it there), then ``gpu_transform``, seeded from the
iterator's base seed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fastfeed.device.copiers import Copier, CpuCopier, StreamCopier
from fastfeed.device.own_streams import own_stream
from fastfeed.device.pinned import PinHelper, PinnedIterator
from fastfeed.device.prefetch import DeviceIterator, HostIterator, TorchIteratorHost
from fastfeed.device.resolve import resolve_device
from fastfeed.gpu_sampler import GpuSampler
from fastfeed.iterators import BaseIterator
from fastfeed.telemetry import Telemetry

__all__ = ["DeviceStage", "StagePlan", "chain"]


@dataclass(frozen=True)
class StagePlan:
    """The device stage's part of an epoch's plan.

    Attributes:
        target: the device the batches are delivered on (resolved), or None.
        pinned_ahead: without a device, with ``pin_memory=True`` and CUDA: the batches pinned
            ahead of the consumer (0: in ``next()``); None: no pinning.
        transform: run on each batch on the device, on the copy stream (see :func:`chain`).
        gpu_transform: the user's, the transform's last part: seeded from the iterator's base
            seed when it has a ``seed`` method.
        prefetch_depth: batches copied ahead of the consumer.
        auto_collation: the loader batches samples itself (how delivered samples are counted).
        watches_gpu: the batches head for a CUDA device (fastfeed copies them there, or they
            are pinned for the user's copy): the stage's GPU sampler reads it.
    """

    target: torch.device | None = None
    pinned_ahead: int | None = None
    transform: Callable[[Any], Any] | None = None
    gpu_transform: Callable[[Any], Any] | None = None
    prefetch_depth: int = 2
    auto_collation: bool = True
    watches_gpu: bool = False


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


def chain(first: Callable[[Any], Any] | None, then: Callable[[Any], Any] | None
          ) -> Callable[[Any], Any] | None:
    """``then(first(batch))``, or whichever of the two is given (None: neither)."""
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
            self._gpu_sampler = GpuSampler(self.cuda_index())
        return self._gpu_sampler

    def cuda_index(self) -> int | None:
        """The CUDA device the batches go to (resolved); None for another device, or none."""
        target = self._target
        return target.index if target is not None and target.type == "cuda" else None

    def wrap(self, host: Any, plan: StagePlan) -> Any:
        """What the consumer iterates for ``host`` (a FastLoader iterator, or torch's for a
        DataPipe), as ``plan`` says."""
        if plan.watches_gpu and self._gpu_sampler is None:
            sampler = self.gpu_sampler()
            sampler.start()
            weakref.finalize(self, sampler.stop)
        target = plan.target
        if target is None:
            # torch's own iterators (DataPipes) pin their batches themselves.
            if plan.pinned_ahead is None or not isinstance(host, BaseIterator):
                return host
            pinned = PinnedIterator(host, plan.pinned_ahead, self._telemetry,
                                    plan.auto_collation)
            self._pin_helper = pinned.helper
            return pinned
        source: HostIterator = host if isinstance(host, BaseIterator) else TorchIteratorHost(host)
        if plan.gpu_transform is not None and hasattr(plan.gpu_transform, "seed"):
            # Seeded from the base seed the iterator already drew: no extra generator draws.
            plan.gpu_transform.seed(source.base_seed)
        copier: Copier = CpuCopier(target)
        if target.type == "cuda":
            if self.copy_stream is None:  # the process's, never one of torch's pool
                self.copy_stream = own_stream(target, "copy")
            copier = StreamCopier(target, self.copy_stream)
        return DeviceIterator(source, copier, plan.prefetch_depth, plan.transform,
                              self._telemetry, plan.auto_collation)
