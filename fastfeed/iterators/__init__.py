"""FastLoader's own iterators: in-process, and a pool of worker processes feeding the ring."""

from fastfeed.iterators.base import BaseIterator
from fastfeed.iterators.pool import WorkerPoolIterator
from fastfeed.iterators.setup import IteratorSetup, Learned
from fastfeed.iterators.single import SingleProcessIterator

__all__ = ["BaseIterator", "IteratorSetup", "Learned", "SingleProcessIterator",
           "WorkerPoolIterator"]
