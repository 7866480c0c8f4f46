"""The produce step: an index in, a batch out. One step for every kind of worker (processes,
threads) and for ``num_workers=0``, so that a feature cannot work in one mode and silently
not in another.

fetch the samples (reseeded per sample with ``deterministic=True``) → drop the skipped ones →
note the IterableDataset's ``state_dict()`` → collate (into the task's pool slot, if any) →
encode the batch for the trip to the main process (a worker process) or hand it over as it is
(a worker thread, whose slot's lease the batch's tensors already hold).
"""

from __future__ import annotations

import contextlib
import random
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from fastfeed.codec import encode
from fastfeed.collate import as_collate_into
from fastfeed.fetch import Fetcher, make_fetcher
from fastfeed.protocol import InPlace, Produced, WorkerConfig
from fastfeed.resume import has_snapshot_protocol
from fastfeed.skip import drop_skipped
from fastfeed.slots.arena import ThreadSlots, WorkerSlots

__all__ = ["Producer", "sample_seed", "seed_all"]


def sample_seed(base_seed: int, epoch: int, index: Any) -> int:
    """A seed for one sample of one epoch, the same whichever worker reads it."""
    key = index if isinstance(index, int) else zlib.crc32(repr(index).encode())
    mixed = (base_seed ^ (epoch * 0x9E3779B97F4A7C15) ^ (key * 0xBF58476D1CE4E5B9)) & (2**64 - 1)
    mixed = ((mixed ^ (mixed >> 31)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (mixed ^ (mixed >> 29)) & (2**63 - 1)


def seed_all(seed: int) -> None:
    """Seed ``random``, torch and numpy's global generators, as torch seeds a worker."""
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


@contextlib.contextmanager
def _global_rngs_kept() -> Iterator[None]:
    """Restore the global generators afterwards: the main process's own random stream
    (dropout, the next epoch's shuffle) must not depend on the samples' reseeding."""
    states = random.getstate(), torch.get_rng_state(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        torch.set_rng_state(states[1])
        np.random.set_state(states[2])


class Producer:
    """Produces the batches of one worker (or of the main process with ``num_workers=0``).

    Args:
        config: the worker's configuration (the dataset, collate, seeds).
        slots: how the worker reaches the slot pool, if the loader has one, else None:
            batches are then returned as they are.
        in_main_process: reseeding for ``deterministic=True`` leaves the global generators as
            they were (a worker process owns its generators; the main process does not).
    """

    def __init__(self, config: WorkerConfig, slots: WorkerSlots | ThreadSlots | None = None,
                 in_main_process: bool = False) -> None:
        self.config = config
        self._slots = slots
        self._in_main_process = in_main_process
        self._collate_into = as_collate_into(config.collate_fn)
        self._tracks_state = config.iterable and has_snapshot_protocol(config.dataset)
        self._fetcher: Fetcher | None = None

    def start_epoch(self, epoch: int = 0, dataset_state: Any = None) -> None:
        """Start reading epoch ``epoch`` (an IterableDataset replica from ``dataset_state``)."""
        config = self.config
        if dataset_state is not None:
            config.dataset.load_state_dict(dataset_state)
        reseed: Callable[[Any], None] | None = None
        if config.deterministic:
            def reseed(index: Any) -> None:
                seed_all(sample_seed(config.base_seed, epoch, index))
        self._fetcher = make_fetcher(config.dataset, config.iterable, config.auto_collation,
                                     config.drop_last, reseed)

    def produce(self, index: Any, slot_id: int | None = None) -> Produced:
        """The batch of ``index``, in pool slot ``slot_id`` when there is a slot pool.

        Raises:
            StopIteration: an IterableDataset replica is exhausted.
        """
        assert self._fetcher is not None, "start_epoch() first"
        start = time.perf_counter()
        reseeding = self.config.deterministic and self._in_main_process
        with _global_rngs_kept() if reseeding else contextlib.nullcontext():
            samples, skipped = drop_skipped(self._fetcher.fetch(index),
                                            self.config.auto_collation)
        dataset_state = self.config.dataset.state_dict() if self._tracks_state else None
        fetched = time.perf_counter()
        if self._slots is None:
            batch = self.config.collate_fn(samples)
        else:
            # Only now, and only for this call: a slot of the worker's own is not made for a
            # fetch that fails, and its mapping goes with this frame once the main process has
            # its handle.
            arena = self._slots.arena(slot_id)
            collated = self._collate_into(samples, arena.empty)
            batch = (InPlace(collated, arena.requested) if self._slots.in_this_process
                     else encode(collated, arena))
            self._slots.written(batch.required)
        return Produced(batch, fetched - start, time.perf_counter() - fetched, dataset_state,
                        skipped)
