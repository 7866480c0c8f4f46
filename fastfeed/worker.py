"""The worker loop: take tasks, produce their batches, answer (see :mod:`fastfeed.protocol`).

In a process, seeding, ``get_worker_info()``, ``worker_init_fn``, IterableDataset exhaustion
and persistent-worker epochs follow torch's worker loop, so a dataset cannot tell the
difference; only where the batch is written differs. In a thread (``worker_mode="thread"``)
the batch is handed over as it is; threads share the process's global RNGs, so they are not
seeded, and :func:`fastfeed.worker_info` (not torch's ``get_worker_info``) describes them.
"""

from __future__ import annotations

import gc
import os
import queue
import random
import threading
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from fastfeed._copy import set_copy_threads
from fastfeed._proc import available_cpus
from fastfeed._torch_compat import (
    ExceptionWrapper,
    name_worker_process,
    numpy_seed,
    set_worker_info,
    thread_worker_info,
)
from fastfeed.inherited_fds import release_inherited
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
from fastfeed.shared_lists import ListsHandOff, received_config
from fastfeed.slots.arena import WorkerSlots
from fastfeed.slots.control import ControlPipe

__all__ = ["worker_info", "worker_loop"]

# How often an idle worker checks that the main process is still alive.
WATCHDOG_INTERVAL = 1.0

_thread_local = threading.local()


def worker_info() -> Any:
    """Describe the current worker, process or thread; ``None`` outside workers.

    Like :func:`torch.utils.data.get_worker_info`, but also right in thread workers, where it
    carries per-thread generators in ``rng`` and ``worker_method="thread"``.
    """
    return getattr(_thread_local, "info", None) or get_worker_info()


def _setup(config: WorkerConfig) -> None:
    seed = config.base_seed + config.worker_id
    if config.thread:
        _thread_local.info = thread_worker_info(config.worker_id, config.num_workers, seed,
                                                config.dataset)
        return
    name_worker_process()
    torch.set_num_threads(1)
    set_copy_threads(max(1, available_cpus() // config.num_workers))
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(numpy_seed(config.base_seed, config.worker_id))
    set_worker_info(config.worker_id, config.num_workers, seed, config.dataset)


def worker_loop(
    config: WorkerConfig | ListsHandOff,
    task_queue: Any,
    result_queue: Any,
    shutting_down: ShutdownFlag,
    control: ControlPipe | None,
) -> None:
    """Run one worker until told to stop, or until the main process disappears.

    Once ``shutting_down`` is set (the pool shuts down), queued tasks are skipped.
    """
    config = received_config(config)  # first: the dataset reads its shared lists from here on
    kind = "thread" if config.thread else "process"
    if threading.current_thread() is threading.main_thread():
        # A worker process of its own (not a thread, nor a Ray actor's loop). Forked: it
        # closes what it inherited of the main process's loaders, and the inherited objects
        # move out of reach of its garbage collector, whose full collections would otherwise
        # write to (so copy) every page that holds one.
        release_inherited(keep=(task_queue, result_queue))
        gc.freeze()
    where = f"in DataLoader worker {kind} {config.worker_id}"
    try:
        _setup(config)
        producer = Producer(config, None if control is None else WorkerSlots(control))
        start_error: Failed | None = None
        try:
            if config.worker_init_fn is not None:
                config.worker_init_fn(config.worker_id)
            producer.start_epoch(0, config.dataset_state)
        except Exception:
            start_error = Failed(ExceptionWrapper(where=where))

        parent = os.getppid()
        replica_ended = False
        while os.getppid() == parent:
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
        if control is not None:
            control.close()
    if shutting_down.is_set() and not config.thread:
        result_queue.cancel_join_thread()
        result_queue.close()
