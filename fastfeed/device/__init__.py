"""The device stage: what a batch goes through between the host iterator and the consumer.

* :mod:`~fastfeed.device.stage`: the one factory that assembles the stage for each iterator,
  as the epoch's plan (:mod:`fastfeed.planning`) says;
* :mod:`~fastfeed.device.prefetch`: batches copied to the device some batches ahead;
* :mod:`~fastfeed.device.pinned`: without a device, batches copied into pinned memory ahead
  of the consumer (``pin_memory=True``);
* :mod:`~fastfeed.device.copiers`: copying one batch (the CUDA stream rules);
* :mod:`~fastfeed.device.resolve`: which device ``device=`` means.
"""

from fastfeed.device.copiers import Copier, CpuCopier, StreamCopier, pinned_source
from fastfeed.device.pinned import PinnedIterator
from fastfeed.device.prefetch import DeviceIterator, HostIterator, TorchIteratorHost
from fastfeed.device.resolve import check_device, resolve_device, training_device
from fastfeed.device.stage import DeviceStage, StagePlan, chain

__all__ = [
    "Copier",
    "CpuCopier",
    "DeviceIterator",
    "DeviceStage",
    "HostIterator",
    "PinnedIterator",
    "StagePlan",
    "StreamCopier",
    "TorchIteratorHost",
    "chain",
    "check_device",
    "pinned_source",
    "resolve_device",
    "training_device",
]
