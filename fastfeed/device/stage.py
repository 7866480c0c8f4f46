"""The device stage, assembled in one place: what wraps a loader's host iterator.

A loader has one :class:`DeviceStage`, made with it and kept across epochs. For each new host
iterator, :meth:`DeviceStage.wrap` builds what its batches go through on their way to the
consumer, from the loader's arguments (:class:`StageOptions`):

* no ``device``: the host iterator itself;
* ``device="cpu"``: a :class:`~fastfeed.device.prefetch.DeviceIterator` with a
  :class:`~fastfeed.device.copiers.HostCopier`;
* ``device="cuda"``: the same with a :class:`~fastfeed.device.copiers.StreamCopier` on the
  loader's copy stream (one per loader), its slots page-locked for that GPU.

The transforms run on the device in order: the tail of what the workers make (a dataset's
batch tail), then ``gpu_transform``, seeded from the iterator's base seed. The stage also
keeps the NVML sampler that reads the GPU the batches go to.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fastfeed.device.copiers import Copier, HostCopier, StreamCopier
from fastfeed.device.prefetch import DeviceIterator, HostIterator, TorchIteratorHost
from fastfeed.device.resolve import resolve_device
from fastfeed.iterators import BaseIterator
from fastfeed.telemetry import GpuSampler, Telemetry

__all__ = ["DeviceStage", "StageOptions"]


@dataclass(frozen=True)
class StageOptions:
    """What the loader's arguments ask of the device stage.

    Attributes:
        device: the loader's checked ``device`` (a bare ``"cuda"`` is resolved at the first
            iteration), or None.
        pin_memory: the loader's ``pin_memory``.
        prefetch_depth: batches copied ahead of the consumer.
        gpu_transform: run on each batch on the device, after the copy.
    """

    device: torch.device | None
    pin_memory: bool = False
    prefetch_depth: int = 2
    gpu_transform: Callable[[Any], Any] | None = None


def _chain(first: Callable[[Any], Any] | None, then: Callable[[Any], Any] | None
           ) -> Callable[[Any], Any] | None:
    if first is None or then is None:
        return first or then
    return lambda batch: then(first(batch))


class DeviceStage:
    """One loader's device stage: the device it delivers to (resolved once), its copy stream
    and its GPU sampler, which every epoch's iterator shares.

    Args:
        telemetry: the loader's, which the stage's iterators report to.
    """

    def __init__(self, telemetry: Telemetry) -> None:
        self._telemetry = telemetry
        self._target: torch.device | None = None  # the device, resolved at first use
        self.copy_stream: Any = None  # one per loader, created on first use
        self._gpu_sampler: GpuSampler | None = None

    def target(self, device: torch.device | None) -> torch.device | None:
        """``device``, resolved the first time it is asked for (at the first iteration, once
        the training script has chosen its GPU), then kept."""
        if device is not None and self._target is None:
            self._target = resolve_device(device)
        return self._target

    def copy_device(self, device: torch.device | None) -> int | None:
        """The CUDA device fastfeed copies batches to itself (``device="cuda"``), whose
        copies it owns and fences, so that ring slots may be page-locked for it; else None."""
        target = self.target(device)
        return target.index if target is not None and target.type == "cuda" else None

    def gpu_sampler(self) -> GpuSampler:
        """The sampler of the GPU the batches go to (the current device when fastfeed copies
        nothing), made on first use."""
        if self._gpu_sampler is None:
            target = self._target
            self._gpu_sampler = GpuSampler(
                target.index if target is not None and target.type == "cuda" else None)
        return self._gpu_sampler

    def wrap(self, host: Any, options: StageOptions) -> Any:
        """What the consumer iterates for ``host`` (a FastLoader iterator, or torch's for a
        DataPipe)."""
        target = self.target(options.device)
        heads_to_cuda = (target is not None and target.type == "cuda") or (
            options.pin_memory and torch.cuda.is_available())
        if heads_to_cuda and self._gpu_sampler is None:
            sampler = self.gpu_sampler()
            sampler.start()
            weakref.finalize(self, sampler.stop)
        if target is None:
            return host
        source: HostIterator = host if isinstance(host, BaseIterator) else TorchIteratorHost(host)
        gpu_transform = options.gpu_transform
        if gpu_transform is not None and hasattr(gpu_transform, "seed"):
            # Seeded from the base seed the iterator already drew: no extra generator draws.
            gpu_transform.seed(source.base_seed)
        copier: Copier = HostCopier(target)
        if target.type == "cuda":
            if self.copy_stream is None:
                self.copy_stream = torch.cuda.Stream(target)
            copier = StreamCopier(target, self.copy_stream)
        # The tail of what the workers make (persistent workers keep the first iterator's)
        # runs first, on the copy stream.
        transform = _chain(source.device_tail, gpu_transform)
        return DeviceIterator(source, copier, options.prefetch_depth, transform, self._telemetry)
