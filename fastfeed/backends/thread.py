"""Worker threads in this process (``worker_mode="thread"``): no IPC, no pickling, for work
that releases the GIL. A batch is handed over as it is: no slot pool.

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
from fastfeed.protocol import FromWorker, ShutdownFlag, SlotAdded, Stop, ToWorker, WorkerConfig
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
        pass  # a thread hands its batch over as it is: it maps no slot

    def exit_reason(self) -> str | None:
        return None if self.thread.is_alive() else "the thread ended."


class ThreadBackend(OnThisMachine):
    """Worker threads in this process."""

    name: ClassVar[str] = "thread"
    traits: ClassVar[BackendTraits] = BackendTraits(uses_slot_pool=False, in_this_process=True)

    def __init__(self, args: BackendArgs) -> None:
        self._results: queue.Queue[FromWorker] = queue.Queue()
        self._shutting_down = ShutdownFlag()
        self.workers: list[ThreadWorker] = []

    def start(self, config: WorkerConfig) -> ThreadWorker:
        task_queue: queue.Queue[ToWorker] = queue.Queue()
        thread = threading.Thread(
            target=_run_worker,
            args=(config, task_queue, self._results, self._shutting_down, None, share_process,
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

    def shutdown(self, wait: bool = True, then: Callable[[], None] | None = None) -> None:
        # Thread workers write no pool slot: ``then`` has nothing to wait for.
        self._shutting_down.set()
        for worker in self.workers:
            worker.send(Stop())
        if then is not None:
            then()
        if not wait:
            return  # threads cannot be terminated; each is a daemon and ends after its task
        deadline = time.monotonic() + SHUTDOWN_GRACE
        for worker in self.workers:
            # A thread busy in a long __getitem__ cannot be stopped; it is a daemon and ends
            # with its task.
            worker.thread.join(timeout=max(0.0, deadline - time.monotonic()))
