"""Where workers run: processes (the default; batches cross through the ring), threads, or
Ray actors on a cluster (:mod:`fastfeed.backends.ray.backend`).

A backend starts workers and owns what they share with the main process: the result queue,
the shutdown flag and, for processes, each worker's task queue and control pipe, over which
it tells the worker of the ring's slots. The pool iterator above it only dispatches tasks and
orders results.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import queue
import signal
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import send_handle
from typing import Any

from fastfeed.protocol import SlotAdded, SlotDropped, Stop, WorkerConfig
from fastfeed.ring import SlotRing
from fastfeed.worker import worker_loop

__all__ = ["ProcessBackend", "ThreadBackend", "WorkerHandle"]

# How long shutdown waits for workers to exit on their own before terminating them: at the
# end of an epoch (idle workers exit at once), and when an iterator was abandoned mid-epoch
# (a worker may be busy in a long __getitem__ whose result nobody wants).
SHUTDOWN_GRACE = 2.0
ABANDONED_GRACE = 0.5

_PICKLE_ERROR = (
    "Got pickle error when attempting to start a worker Process. This might be because the "
    "worker Process arguments are not picklable (with the 'spawn' and 'forkserver' start "
    "methods, the dataset, collate_fn and worker_init_fn must be). You can also try "
    "multiprocessing.set_start_method('fork')."
)


@dataclass
class WorkerHandle:
    worker_id: int
    runner: Any  # multiprocessing.Process, threading.Thread or ray_backend.RemoteWorker
    task_queue: Any
    control: Any = None  # the main side of a process worker's control pipe

    @property
    def pid(self) -> int:
        """The process id (this process's, for a thread)."""
        return getattr(self.runner, "pid", None) or os.getpid()

    @property
    def task_id(self) -> int | None:
        """The kernel task that runs the worker's loop: the process's pid, or the thread's
        native id (``/proc/<id>`` names either); None before the worker starts."""
        if isinstance(self.runner, threading.Thread):
            return self.runner.native_id
        return getattr(self.runner, "pid", None)

    def exit_reason(self) -> str | None:
        """Why the worker is gone, or None while it runs."""
        exitcode = getattr(self.runner, "exitcode", None)
        if isinstance(self.runner, threading.Thread):
            return None if self.runner.is_alive() else "the thread ended."
        if exitcode is None:
            return None
        if exitcode >= 0:
            return f"exit code {exitcode}."
        signum = -exitcode
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        hint = ""
        if signum == signal.SIGBUS:
            hint = " This usually means /dev/shm is full: enlarge it (docker --shm-size)."
        elif signum == signal.SIGKILL:
            hint = " It may have been killed by the out-of-memory killer."
        return f"killed by signal {signum} ({name}).{hint}"


class ProcessBackend:
    """Worker processes from ``ctx`` (fork, spawn or forkserver), fed through the ring."""

    kind = "process"

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self.result_queue = ctx.Queue()
        self.shutting_down = ctx.RawValue(ctypes.c_bool, False)

    def start(self, config: WorkerConfig, ring: SlotRing | None) -> WorkerHandle:
        task_queue = self._ctx.Queue()
        task_queue.cancel_join_thread()
        # Without a ring (ring_slots=0), no control pipe: batches take torch's shared memory.
        control = worker_control = None
        if ring is not None:
            control, worker_control = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=worker_loop,
            args=(config, task_queue, self.result_queue, self.shutting_down, worker_control),
            daemon=True,
        )
        handle = WorkerHandle(config.worker_id, process, task_queue, control)
        try:
            process.start()
        except (TypeError, AttributeError, pickle.PicklingError):
            warnings.warn(_PICKLE_ERROR, stacklevel=2)  # torch's warning, for spawn/forkserver
            raise
        if ring is not None:
            assert control is not None and worker_control is not None
            worker_control.close()
            # A worker added late maps the slots that exist already.
            for slot_id, nbytes, fd in ring.fds():
                _send_slot(handle, slot_id, nbytes, fd)
        return handle

    def announce(self, handle: WorkerHandle, created: list, retired: list[int]) -> None:
        """Tell a worker of the slots the ring created and dropped."""
        if handle.runner.exitcode is not None:
            return
        try:
            for slot_id in retired:
                handle.control.send(SlotDropped(slot_id))
            for slot in created:
                _send_slot(handle, slot.slot_id, slot.nbytes, slot.fd)
        except OSError:
            pass  # the worker died; the pool's liveness check reports it

    def shutdown(self, handles: list[WorkerHandle], wait: bool = True,
                 then: Callable[[], None] | None = None) -> None:
        """Ask the workers to exit, then join them (terminating any still busy after the
        grace), then call ``then``: nothing of theirs can write shared memory any more. With
        ``wait=False`` (from a finaliser) a reaper thread joins them instead, so that the
        thread the garbage collector happened to run in is never blocked."""
        self.shutting_down.value = True
        try:
            for handle in handles:
                if handle.runner.exitcode is None:
                    handle.task_queue.put(Stop())
        finally:
            if wait:
                try:
                    self._stop(handles, SHUTDOWN_GRACE, then)
                finally:
                    self._close(handles)
            else:
                # The reaper closes nothing: reference counting does, once it drops the
                # handles. The collector may already have finalised (closed) these pipes,
                # and closing one again could close an fd number reused since.
                threading.Thread(target=self._stop, args=(handles, ABANDONED_GRACE, then),
                                 name="fastfeed-reaper", daemon=True).start()

    @staticmethod
    def _stop(handles: list[WorkerHandle], grace: float,
              then: Callable[[], None] | None = None) -> None:
        try:
            deadline = time.monotonic() + grace
            for handle in handles:
                handle.runner.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for handle in handles:
                if handle.runner.exitcode is None:
                    handle.runner.terminate()
                    handle.runner.join(timeout=SHUTDOWN_GRACE)
            if then is not None and all(_exited(h.runner) for h in handles):
                then()

    def _close(self, handles: list[WorkerHandle]) -> None:
        for handle in handles:
            handle.task_queue.cancel_join_thread()
            handle.task_queue.close()
            if handle.control is not None:
                handle.control.close()
        self.result_queue.cancel_join_thread()
        self.result_queue.close()


class _Flag:
    """The thread backend's shutdown flag: a plain attribute, like RawValue's ``value``."""

    value = False


class ThreadBackend:
    """Worker threads in this process: no IPC, no pickling; for GIL-releasing work."""

    kind = "thread"

    def __init__(self) -> None:
        self.result_queue: queue.Queue = queue.Queue()
        self.shutting_down = _Flag()

    def start(self, config: WorkerConfig, ring: SlotRing | None) -> WorkerHandle:
        task_queue: queue.Queue = queue.Queue()
        thread = threading.Thread(
            target=worker_loop,
            args=(config, task_queue, self.result_queue, self.shutting_down, None),
            name=f"fastfeed-worker-{config.worker_id}",
            daemon=True,
        )
        thread.start()
        return WorkerHandle(config.worker_id, thread, task_queue)

    def announce(self, handle: WorkerHandle, created: list, retired: list[int]) -> None:
        pass  # threads share the batch directly: no ring

    def shutdown(self, handles: list[WorkerHandle], wait: bool = True,
                 then: Callable[[], None] | None = None) -> None:
        # Thread workers write no ring slot: ``then`` has nothing to wait for.
        self.shutting_down.value = True
        for handle in handles:
            handle.task_queue.put(Stop())
        if then is not None:
            then()
        if not wait:
            return  # threads cannot be terminated; each is a daemon and ends after its task
        deadline = time.monotonic() + SHUTDOWN_GRACE
        for handle in handles:
            # A thread busy in a long __getitem__ cannot be stopped; it is a daemon and ends
            # with its task.
            handle.runner.join(timeout=max(0.0, deadline - time.monotonic()))


def _send_slot(handle: WorkerHandle, slot_id: int, nbytes: int, fd: int) -> None:
    handle.control.send(SlotAdded(slot_id, nbytes))
    send_handle(handle.control, fd, handle.pid)


def _exited(process: Any) -> bool:
    """Whether ``process`` is gone. Its exit code alone is not enough: when another
    ``waitpid`` in this process reaps the child first (seen in the leak tests, while the next
    epoch's workers start), multiprocessing's handle never learns the code."""
    if process.exitcode is not None:
        return True
    try:
        os.kill(process.pid, 0)
    except ProcessLookupError:
        return True
    return False
