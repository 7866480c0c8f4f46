"""FastLoader's own iterators: in the main process (``num_workers=0``), and a pool of workers
(processes feeding the slot pool, threads, or Ray actors on a cluster). Both hand batches to the
loader, or to the device stage through the contract of :class:`BaseIterator`."""

from fastfeed.iterators.base_iterator import BaseIterator, HostBatch, Position
from fastfeed.iterators.pool import WorkerPoolIterator
from fastfeed.iterators.setup import (
    CarryOver,
    HostTerms,
    IteratorPlanner,
    IteratorSetup,
    PoolOptions,
)
from fastfeed.iterators.single import SingleProcessIterator

__all__ = [
           "BaseIterator",
           "CarryOver",
           "HostBatch",
           "HostTerms",
           "IteratorPlanner",
           "IteratorSetup",
           "PoolOptions",
           "Position",
           "SingleProcessIterator",
           "WorkerPoolIterator",
]
