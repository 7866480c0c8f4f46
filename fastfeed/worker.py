"""The worker: fetch samples, collate them (into a ring slot), hand the batch over.

In a process, seeding, ``get_worker_info()``, ``worker_init_fn``, IterableDataset exhaustion
and persistent-worker resumes follow torch's worker loop, so a dataset cannot tell the
difference; only where the batch is written differs. In a thread (``worker_mode="thread"``)
the batch is handed over as it is; threads share the process's global RNGs, so they are not
seeded, and :func:`fastfeed.worker_info` (not torch's ``get_worker_info``) describes them.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import get_worker_info

from fastfeed._copy import set_copy_threads
from fastfeed._proc import available_cpus
from fastfeed._torch_compat import (
    default_collate,
    numpy_seed,
    set_worker_info,
    thread_worker_info,
)
from fastfeed.codec import encode
from fastfeed.collate import collate_into
from fastfeed.fetch import Fetcher, make_fetcher
from fastfeed.resume import has_snapshot_protocol
from fastfeed.ring import WorkerSlots
from fastfeed.skip import drop_skipped

__all__ = ["Produced", "Resume", "WorkerConfig", "WorkerDone", "worker_info", "worker_loop"]

# How often an idle worker checks that the main process is still alive.
WATCHDOG_INTERVAL = 1.0

_thread_local = threading.local()


def worker_info() -> Any:
    """Describe the current worker, process or thread; ``None`` outside workers.

    Like :func:`torch.utils.data.get_worker_info`, but also right in thread workers, where it
    carries per-thread generators in ``rng`` and ``worker_method="thread"``.
    """
    return getattr(_thread_local, "info", None) or get_worker_info()


@dataclass(frozen=True)
class WorkerDone:
    """An IterableDataset replica is exhausted in worker ``worker_id``."""

    worker_id: int


@dataclass(frozen=True)
class Resume:
    """Start a new epoch on a persistent worker; echoed back as the acknowledgement.

    ``dataset_state`` (from a loader snapshot) is loaded into the IterableDataset replica first.
    """

    epoch: int
    dataset_state: Any = None


@dataclass(frozen=True)
class Produced:
    """A batch from a worker: ``Encoded`` from a process, the batch itself from a thread,
    with the worker's timings and its IterableDataset ``state_dict()`` after the fetch."""

    batch: Any
    fetch_s: float
    collate_s: float
    dataset_state: Any = None
    skipped: int = 0


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs, picklable for spawn and forkserver."""

    dataset: Any
    iterable: bool
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    drop_last: bool
    base_seed: int
    worker_init_fn: Callable[[int], None] | None
    worker_id: int
    num_workers: int
    dataset_state: Any = None  # resume this IterableDataset replica from a snapshot
    thread: bool = False
    deterministic: bool = False

    @property
    def tracks_state(self) -> bool:
        return self.iterable and has_snapshot_protocol(self.dataset)

    def fetcher(self, dataset_state: Any = None, epoch: int = 0) -> Fetcher:
        if dataset_state is not None:
            self.dataset.load_state_dict(dataset_state)
        reseed = None
        if self.deterministic:
            def reseed(index: Any) -> None:
                _seed_all(_sample_seed(self.base_seed, epoch, index))
        return make_fetcher(self.dataset, self.iterable, self.auto_collation, self.drop_last,
                            reseed)


def _sample_seed(base_seed: int, epoch: int, index: Any) -> int:
    """A seed for one sample of one epoch, the same whichever worker reads it."""
    key = index if isinstance(index, int) else zlib.crc32(repr(index).encode())
    mixed = (base_seed ^ (epoch * 0x9E3779B97F4A7C15) ^ (key * 0xBF58476D1CE4E5B9)) & (2**64 - 1)
    mixed = ((mixed ^ (mixed >> 31)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (mixed ^ (mixed >> 29)) & (2**63 - 1)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


def _setup(config: WorkerConfig) -> None:
    seed = config.base_seed + config.worker_id
    if config.thread:
        _thread_local.info = thread_worker_info(config.worker_id, config.num_workers, seed,
                                                config.dataset)
        return
    torch.set_num_threads(1)
    set_copy_threads(max(1, available_cpus() // config.num_workers))
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(numpy_seed(config.base_seed, config.worker_id))
    set_worker_info(config.worker_id, config.num_workers, seed, config.dataset)


def _produce(config: WorkerConfig, fetcher: Fetcher, index: Any,
             slots: WorkerSlots | None, slot_id: int | None) -> Produced:
    start = time.perf_counter()
    samples, skipped = drop_skipped(fetcher.fetch(index), config.auto_collation)
    dataset_state = config.dataset.state_dict() if config.tracks_state else None
    fetched = time.perf_counter()
    # Only now, and only for this call: a private slot is not made for a fetch that fails,
    # and its mapping goes with this frame once the main process has its handle.
    arena = None if slots is None else slots.arena(slot_id)
    if arena is None:
        batch = config.collate_fn(samples)
    elif config.collate_fn is default_collate:
        batch = collate_into(samples, arena)
    elif hasattr(config.collate_fn, "collate_into"):  # a slot-aware collate (fastfeed.vision)
        batch = config.collate_fn.collate_into(samples, arena.empty_or_new)
    else:
        batch = config.collate_fn(samples)
    if slots is not None:
        assert arena is not None
        batch = encode(batch, arena)
        slots.note_required(batch.required)
    return Produced(batch, fetched - start, time.perf_counter() - fetched, dataset_state,
                    skipped)


def worker_loop(
    config: WorkerConfig,
    index_queue: Any,
    result_queue: Any,
    shutting_down: Any,
    control: Connection | None,
) -> None:
    """Run one worker until told to stop, or until the main process disappears.

    ``shutting_down.value`` turns true when the pool shuts down: queued tasks are then skipped.
    It is a lock-free shared flag on purpose: a lock shared with workers can be left held by
    one that is killed, and the main process would then hang on it while shutting down.
    """
    kind = "thread" if config.thread else "process"
    where = f"in DataLoader worker {kind} {config.worker_id}"
    try:
        _setup(config)
        init_error: ExceptionWrapper | None = None
        fetcher: Fetcher | None = None
        try:
            if config.worker_init_fn is not None:
                config.worker_init_fn(config.worker_id)
            fetcher = config.fetcher(config.dataset_state)
        except Exception:
            init_error = ExceptionWrapper(where=where)

        slots = None if control is None else WorkerSlots(control)
        parent = os.getppid()
        iteration_end = False
        while os.getppid() == parent:
            try:
                task = index_queue.get(timeout=WATCHDOG_INTERVAL)
            except queue.Empty:
                continue
            if task is None:
                break
            if isinstance(task, Resume):
                iteration_end = False
                if init_error is None:
                    try:
                        fetcher = config.fetcher(task.dataset_state, task.epoch)
                    except Exception:
                        init_error = ExceptionWrapper(where=where)
                result_queue.put((task, None))
                continue
            if shutting_down.value or iteration_end:
                continue
            idx, index, slot_id = task
            result: Any
            if init_error is not None or fetcher is None:
                result = init_error
            else:
                try:
                    result = _produce(config, fetcher, index, slots, slot_id)
                except StopIteration:
                    if not config.iterable:
                        result = ExceptionWrapper(where=where)
                    else:
                        result = WorkerDone(config.worker_id)
                        iteration_end = True
                except Exception:
                    result = ExceptionWrapper(where=where)
            result_queue.put((idx, result))
            del result, task
    except KeyboardInterrupt:
        pass  # the main process sees Ctrl-C too and shuts the pool down
    finally:
        if control is not None:
            control.close()
    if shutting_down.value and not config.thread:
        result_queue.cancel_join_thread()
        result_queue.close()
