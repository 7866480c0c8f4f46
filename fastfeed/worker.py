"""The worker process: fetch samples, collate them into a ring slot, send a small message.

Seeding, ``get_worker_info()``, ``worker_init_fn``, IterableDataset exhaustion and
persistent-worker resumes follow torch's worker loop, so a dataset cannot tell the
difference; only where the batch is written differs.
"""

from __future__ import annotations

import os
import queue
import random
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
from torch._utils import ExceptionWrapper

from fastfeed._torch_compat import default_collate, numpy_seed, set_worker_info
from fastfeed.codec import Encoded, encode
from fastfeed.collate import collate_into
from fastfeed.fetch import Fetcher, make_fetcher
from fastfeed.ring import Arena, WorkerSlots

__all__ = ["Resume", "WorkerConfig", "WorkerDone", "worker_loop"]

# How often an idle worker checks that the main process is still alive.
WATCHDOG_INTERVAL = 1.0


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

    @property
    def tracks_state(self) -> bool:
        return self.iterable and hasattr(self.dataset, "state_dict")

    def fetcher(self, dataset_state: Any = None) -> Fetcher:
        if dataset_state is not None:
            self.dataset.load_state_dict(dataset_state)
        return make_fetcher(self.dataset, self.iterable, self.auto_collation, self.drop_last)


def _seed(config: WorkerConfig) -> int:
    seed = config.base_seed + config.worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(numpy_seed(config.base_seed, config.worker_id))
    return seed


def _produce(config: WorkerConfig, fetcher: Fetcher, index: Any, arena: Arena) -> Encoded:
    samples = fetcher.fetch(index)
    dataset_state = config.dataset.state_dict() if config.tracks_state else None
    if config.collate_fn is default_collate:
        batch = collate_into(samples, arena)
    else:
        batch = config.collate_fn(samples)
    return encode(batch, arena, dataset_state)


def worker_loop(
    config: WorkerConfig,
    index_queue: Any,
    result_queue: Any,
    done_event: Any,
    control: Connection,
) -> None:
    """Run one worker until told to stop, or until the main process disappears."""
    where = f"in DataLoader worker process {config.worker_id}"
    try:
        torch.set_num_threads(1)
        seed = _seed(config)
        set_worker_info(config.worker_id, config.num_workers, seed, config.dataset)
        init_error: ExceptionWrapper | None = None
        fetcher: Fetcher | None = None
        try:
            if config.worker_init_fn is not None:
                config.worker_init_fn(config.worker_id)
            fetcher = config.fetcher(config.dataset_state)
        except Exception:
            init_error = ExceptionWrapper(where=where)

        slots = WorkerSlots(control)
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
                        fetcher = config.fetcher(task.dataset_state)
                    except Exception:
                        init_error = ExceptionWrapper(where=where)
                result_queue.put((task, None))
                continue
            if done_event.is_set() or iteration_end:
                continue
            idx, index, slot_id = task
            result: Any
            if init_error is not None or fetcher is None:
                result = init_error
            else:
                try:
                    slots.sync()
                    buffer = None if slot_id is None else slots.buffer(slot_id)
                    result = _produce(config, fetcher, index, Arena(slot_id, buffer))
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
        control.close()
    if done_event.is_set():
        result_queue.cancel_join_thread()
        result_queue.close()
