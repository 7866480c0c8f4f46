"""The worker loop: take tasks, produce their batches, answer (see :mod:`fastfeed.protocol`).

``worker_init_fn``, IterableDataset exhaustion and persistent-worker epochs follow torch's
worker loop, so a dataset cannot tell the difference; only where the batch is written differs.
What a worker sets up first is its backend's choice: a worker that owns its process
(:func:`own_process`) is seeded and described to ``get_worker_info()`` as torch's are; a
worker thread (:func:`share_process`) shares the process's global RNGs, so it is not seeded,
and :func:`fastfeed.worker_info` (not torch's ``get_worker_info``) describes it.
"""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from fastfeed._proc import available_cpus
from fastfeed._stack import set_copy_threads, set_shares_the_gil
from fastfeed._torch_compat import (
    ExceptionWrapper,
    name_worker_process,
    numpy_seed,
    set_worker_info,
    thread_worker_info,
)
from fastfeed.main_process import MainProcess
from fastfeed.produce import Producer
from fastfeed.protocol import (
    Answer,
    EpochStarted,
    Failed,
    ReplicaEnded,
    ShutdownFlag,
    StartEpoch,
    Stop,
    Task,
    WorkerConfig,
)
from fastfeed.slots.arena import ThreadSlots, WorkerSlots

__all__ = ["own_process", "share_process", "worker_info", "worker_loop"]

# How often an idle worker checks that the main process is still alive.
WATCHDOG_INTERVAL = 1.0

_thread_local = threading.local()


def worker_info() -> Any:
    """Describe the current worker, process or thread; ``None`` outside workers.

    Like :func:`torch.utils.data.get_worker_info`, but also right in thread workers, where it
    carries per-thread generators in ``rng`` and ``worker_method="thread"``.
    """
    return getattr(_thread_local, "info", None) or get_worker_info()


def share_process(config: WorkerConfig) -> None:
    """Set up a worker thread: :func:`worker_info` describes it, with generators of its own,
    its gathers take its share of the cores, as a worker process's do, and its checks keep
    the GIL it shares with the training thread."""
    _thread_local.info = thread_worker_info(config.worker_id, config.num_workers,
                                            config.base_seed + config.worker_id, config.dataset)
    _take_share_of_cores(config)
    set_shares_the_gil(True)


def _take_share_of_cores(config: WorkerConfig) -> None:
    """This worker's gathers use its share of the cores, so that the workers together use
    them all and no more."""
    set_copy_threads(max(1, available_cpus() // config.num_workers))


def own_process(config: WorkerConfig) -> None:
    """Set up a worker that owns its process, as torch sets up its workers: one intra-op
    thread, the global generators seeded from the worker's seed, ``get_worker_info()``."""
    seed = config.base_seed + config.worker_id
    name_worker_process()
    torch.set_num_threads(1)
    _take_share_of_cores(config)
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(numpy_seed(config.base_seed, config.worker_id))
    set_worker_info(config.worker_id, config.num_workers, seed, config.dataset)


def worker_loop(
    config: WorkerConfig,
    task_queue: Any,
    result_queue: Any,
    shutting_down: ShutdownFlag,
    slots: WorkerSlots | ThreadSlots | None,
    setup: Callable[[WorkerConfig], None],
    kind: str,
) -> None:
    """Run one worker until told to stop, or until the main process disappears.

    Once ``shutting_down`` is set (the pool shuts down), queued tasks are skipped.

    Args:
        slots: how the worker reaches the slot pool (None: the loader has none); closed as the
            worker ends.
        setup: :func:`own_process` or :func:`share_process`, run first.
        kind: what runs the worker (``"process"``, ``"thread"``), for its errors' message.
    """
    where = f"in DataLoader worker {kind} {config.worker_id}"
    try:
        setup(config)
        producer = Producer(config, slots)
        start_error: Failed | None = None
        try:
            if config.worker_init_fn is not None:
                config.worker_init_fn(config.worker_id)
            producer.start_epoch(0, config.dataset_state)
        except Exception:
            start_error = Failed(ExceptionWrapper(where=where))

        main = MainProcess(config.main_pid)
        replica_ended = False
        while main.alive():
            try:
                message = task_queue.get(timeout=WATCHDOG_INTERVAL)
            except queue.Empty:
                continue
            except EOFError:  # the main process closed the queue's one writing end: it is gone
                break
            if isinstance(message, Stop):
                break
            if isinstance(message, StartEpoch):
                replica_ended = False
                if start_error is None:
                    try:
                        producer.start_epoch(message.epoch, message.dataset_state)
                    except Exception:
                        start_error = Failed(ExceptionWrapper(where=where))
                result_queue.put(EpochStarted(message.epoch))
                continue
            assert isinstance(message, Task)
            if shutting_down.is_set() or replica_ended:
                continue
            outcome: Any = start_error
            if outcome is None:
                try:
                    outcome = producer.produce(message.index, message.slot_id)
                except StopIteration:
                    if not config.iterable:
                        outcome = Failed(ExceptionWrapper(where=where))
                    else:
                        outcome = ReplicaEnded()
                        replica_ended = True
                except Exception:
                    outcome = Failed(ExceptionWrapper(where=where))
            result_queue.put(Answer(message.seq, outcome))
            del outcome, message
    except KeyboardInterrupt:
        pass  # the main process sees Ctrl-C too and shuts the pool down
    finally:
        if slots is not None:
            slots.close()
