"""Worker threads in this process (``worker_mode="thread"``): no IPC, no pickling, for work
that releases the GIL. A batch is handed over as it is; a collate that takes ``empty`` (torch's
``default_collate`` included) writes it into a slot of the loader's pool, reused as a worker
process's slots are, instead of into fresh memory for every batch.

Worker threads are daemons (a thread inside a long ``__getitem__`` cannot be stopped), but none
may still run when the interpreter finalizes: a daemon thread then inside C++ code (a torch op,
a decoder) is ended by ``pthread_exit``, whose unwinding through those frames aborts the
process ("terminate called without an active exception"), after a ``break`` or a ``del`` of
the iterator as with one still alive. At exit every running worker is told to stop, and
joined: its task in progress ends first.
"""

from __future__ import annotations

import atexit
import functools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fastfeed._torch_compat import is_iterable_dataset
from fastfeed.backends.interface import SHUTDOWN_GRACE, BackendArgs, BackendTraits
from fastfeed.backends.on_this_machine import OnThisMachine, QueueFedWorker
from fastfeed.protocol import (
    FromWorker,
    InPlace,
    ShutdownFlag,
    SlotAdded,
    Stop,
    ToWorker,
    WorkerConfig,
)
from fastfeed.slots import Lease, ThreadSlots
from fastfeed.worker import share_process, worker_loop

__all__ = ["ThreadBackend", "ThreadWorker"]

# Each worker thread still running, with how to stop it (its flag and its queue; nothing that
# holds the thread or the backend). A thread takes itself out as it ends.
_running: dict[threading.Thread, Callable[[], None]] = {}


def _stop(shutting_down: ShutdownFlag, task_queue: queue.Queue) -> None:
    shutting_down.set()
    task_queue.put(Stop())


def _run_worker(*args: Any) -> None:
    try:
        worker_loop(*args)
    finally:
        _running.pop(threading.current_thread(), None)


@atexit.register
def _join_running_workers() -> None:
    for stop in list(_running.values()):
        stop()
    deadline = time.monotonic() + SHUTDOWN_GRACE
    for thread in list(_running):
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


@dataclass
class ThreadWorker(QueueFedWorker):
    """A worker thread and its task queue."""

    worker_id: int
    thread: threading.Thread
    task_queue: queue.Queue = field(default_factory=queue.Queue)
    pid: int = field(default_factory=os.getpid)  # this process's
    process: None = None  # it has none of its own

    @property
    def task_id(self) -> int | None:
        return self.thread.native_id

    def announce_slots(self, created: Sequence[SlotAdded], retired: Sequence[int]) -> None:
        pass  # a thread asks the slot pool for its task's slot: it maps none itself

    def exit_reason(self) -> str | None:
        return None if self.thread.is_alive() else "the thread ended."


class ThreadBackend(OnThisMachine):
    """Worker threads in this process."""

    name: ClassVar[str] = "thread"
    traits: ClassVar[BackendTraits] = BackendTraits(uses_slot_pool=True, in_this_process=True)

    def __init__(self, args: BackendArgs) -> None:
        self._results: queue.Queue[FromWorker] = queue.Queue()
        self._shutting_down = ShutdownFlag()
        self._slot_pool = args.slot_pool
        self.workers: list[ThreadWorker] = []

    def start(self, config: WorkerConfig) -> ThreadWorker:
        task_queue: queue.Queue[ToWorker] = queue.Queue()
        slots = None if self._slot_pool is None else ThreadSlots(self._slot_pool)
        thread = threading.Thread(
            target=_run_worker,
            args=(config, task_queue, self._results, self._shutting_down, slots, share_process,
                  "thread"),
            name=f"fastfeed-worker-{config.worker_id}",
            daemon=True,
        )
        _running[thread] = functools.partial(_stop, self._shutting_down, task_queue)
        thread.start()
        worker = ThreadWorker(config.worker_id, thread, task_queue)
        self.workers.append(worker)
        return worker

    @classmethod
    def refusal(cls, dataset: Any, deterministic: bool) -> str | None:
        if is_iterable_dataset(dataset):
            return ("worker_mode='thread' needs a map-style dataset: IterableDataset replicas "
                    "shard by get_worker_info(), which threads cannot give")
        if deterministic:
            return ("deterministic=True reseeds the global RNGs per sample, which threads "
                    "share: use worker_mode='process'")
        return None

    def rebuild(self, batch: Any, lease: Lease | None) -> Any:
        # Its tensors are views of the memory ``lease`` is on (the slot pool's writer): there
        # is nothing to rebuild.
        return batch.batch if isinstance(batch, InPlace) else batch

    def shutdown(self, wait: bool = True, then: Callable[[], None] | None = None) -> None:
        self._shutting_down.set()
        for worker in self.workers:
            worker.send(Stop())
        threads = [worker.thread for worker in self.workers]
        if wait:
            _join_then(threads, then)
        else:  # from a finaliser, maybe on one of these very threads
            threading.Thread(target=_join_then, args=(threads, then), name="fastfeed-reaper",
                             daemon=True).start()


def _join_then(threads: Sequence[threading.Thread], then: Callable[[], None] | None) -> None:
    """Join ``threads`` for up to :data:`SHUTDOWN_GRACE` seconds, and call ``then`` once none
    of them can write a pool slot any more. A thread busy in a long ``__getitem__`` cannot be
    stopped (a daemon, it ends with its task): ``then`` waits for it on a thread of its own."""
    deadline = time.monotonic() + SHUTDOWN_GRACE
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    running = [thread for thread in threads if thread.is_alive()]
    if then is None:
        return
    if running:
        threading.Thread(target=_join_all_then, args=(running, then), name="fastfeed-reaper",
                         daemon=True).start()
    else:
        then()


def _join_all_then(threads: Sequence[threading.Thread], then: Callable[[], None]) -> None:
    for thread in threads:
        thread.join()
    then()
