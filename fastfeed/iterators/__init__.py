"""FastLoader's own iterators: in the main process (``num_workers=0``), and a pool of workers
(processes feeding the slot pool, threads, or Ray actors on a cluster). Each carries out its
:class:`HostPlan` and hands batches to the loader, or to the device stage through the contract
of :class:`BaseIterator`."""

from fastfeed.iterators.base_iterator import BaseIterator, HostBatch, Position
from fastfeed.iterators.host_plan import CarryOver, HostPlan
from fastfeed.iterators.single import SingleProcessIterator
from fastfeed.iterators.worker_pool import WorkerPoolIterator

__all__ = [
    "BaseIterator",
    "CarryOver",
    "HostBatch",
    "HostPlan",
    "Position",
    "SingleProcessIterator",
    "WorkerPoolIterator",
]
