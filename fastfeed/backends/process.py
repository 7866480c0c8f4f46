"""Worker processes (the default): batches cross through the slot pool.

The backend owns what the workers share with the main process: the result queue and the
shutdown flag; each worker's handle owns its task queue and its control pipe, over which it
is told of the pool's slots. A worker's own life is :mod:`~.process_child`'s, the pipes' ends
:mod:`~.process_pipes`', and stopping the processes :mod:`~.process_reaper`'s.
"""

from __future__ import annotations

import pickle
import signal
import threading
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any, ClassVar

import torch

from fastfeed import inherited_fds
from fastfeed.backends.interface import (
    ABANDONED_GRACE,
    SHUTDOWN_GRACE,
    BackendArgs,
    BackendTraits,
)
from fastfeed.backends.on_this_machine import OnThisMachine, QueueFedWorker
from fastfeed.backends.process_child import run_worker
from fastfeed.backends.process_pipes import fds_for_process, queue_of, unused_ends
from fastfeed.backends.process_reaper import stop_processes
from fastfeed.protocol import ShutdownFlag, SlotAdded, SlotDropped, Stop, WorkerConfig
from fastfeed.shared_lists import ListsSnapshot
from fastfeed.slots.control import ControlPipe

__all__ = ["ProcessBackend", "ProcessWorker"]

_PICKLE_ERROR = (
    "Got pickle error when attempting to start a worker Process. This might be because the "
    "worker Process arguments are not picklable (with the 'spawn' and 'forkserver' start "
    "methods, the dataset, collate_fn and worker_init_fn must be). You can also try "
    "multiprocessing.set_start_method('fork')."
)


@dataclass
class ProcessWorker(QueueFedWorker):
    """A worker process, its task queue and the main side of its control pipe (None without a
    slot pool: batches then take torch's shared memory)."""

    worker_id: int
    process: BaseProcess
    task_queue: Any
    control: ControlPipe | None = None
    #: This process's descriptors for the worker process, and their files (once started).
    parent_ends: dict[int, inherited_fds.File] = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def task_id(self) -> int | None:
        return self.process.pid

    def announce_slots(self, created: Sequence[SlotAdded], retired: Sequence[int]) -> None:
        if self.control is None or self.process.exitcode is not None:
            return
        try:
            for slot_id in retired:
                self.control.send(SlotDropped(slot_id))
            for slot in created:
                self.control.send(slot)
        except OSError:
            pass  # the worker died; the pool's liveness check reports it

    def exit_reason(self) -> str | None:
        exitcode = self.process.exitcode
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


def _reap(workers: list[ProcessWorker], results: Any, shutting_down: ShutdownFlag,
          then: Callable[[], None] | None) -> None:
    """Stop abandoned ``workers``. The thread's arguments (the workers' queues, ``results``,
    ``shutting_down``) are held until it returns: until the workers are gone."""
    stop_processes([w.process for w in workers], ABANDONED_GRACE, then)


class ProcessBackend(OnThisMachine):
    """Worker processes from the loader's ``multiprocessing_context`` (fork, spawn or
    forkserver; torch's default without one), fed through its slot pool (if any); with
    ``share_lists``, they read the dataset's large lists from one shared copy
    (:mod:`fastfeed.shared_lists`)."""

    name: ClassVar[str] = "process"
    traits: ClassVar[BackendTraits] = BackendTraits(uses_slot_pool=True)

    def __init__(self, args: BackendArgs) -> None:
        context: Any = args.multiprocessing_context or torch.multiprocessing
        self._context = context
        self._slot_pool = args.slot_pool
        self._results = queue_of(context)
        self._shutting_down = ShutdownFlag(context)
        self.workers: list[ProcessWorker] = []
        self._lists_cache = args.lists
        self._lists: ListsSnapshot | None = None  # taken as the first worker starts
        inherited_fds.register(self)

    def start(self, config: WorkerConfig) -> ProcessWorker:
        task_queue = queue_of(self._context)
        task_queue.cancel_join_thread()
        control = worker_control = None
        if self._slot_pool is not None:
            control, worker_control = ControlPipe.pair()
        process = self._context.Process(
            target=run_worker,
            args=(self._lists_snapshot(config).hand_off(config), task_queue, self._results,
                  self._shutting_down, worker_control),
            daemon=True,
        )
        worker = ProcessWorker(config.worker_id, process, task_queue, control)
        # Listed before it starts: forked, it finds its own main-side ends here, to close them.
        self.workers.append(worker)
        try:
            process.start()
        except BaseException as error:
            self.workers.remove(worker)
            if isinstance(error, (TypeError, AttributeError, pickle.PicklingError)):
                warnings.warn(_PICKLE_ERROR, stacklevel=2)  # torch's, for spawn/forkserver
            raise
        finally:
            if worker_control is not None:
                worker_control.close()  # the worker has its own end now, or never will
        worker.parent_ends = {fd: inherited_fds.file_of(fd) for fd in fds_for_process(process)}
        # The worker reads its task queue; this process writes it.
        for end in unused_ends(task_queue, reading=True):
            end.close()
        if self._slot_pool is not None:
            # A worker added late maps the slots that exist already.
            worker.announce_slots(self._slot_pool.slots(), [])
        return worker

    def _lists_snapshot(self, config: WorkerConfig) -> ListsSnapshot:
        """The dataset's lists as all of this pool's workers read them: taken when the first
        starts, as a fork gives workers the dataset as it is when they start (the loader's
        last packing, where the lists are unchanged since)."""
        if self._lists is None:
            forking = self._context.get_start_method() == "fork"
            self._lists = (self._lists_cache.snapshot(config.dataset, keep_fd=not forking)
                           if self._lists_cache is not None else ListsSnapshot([], None))
        return self._lists

    def release_inherited(self, keep: Collection[object]) -> None:
        """In a forked worker: close this backend's pipes, but for the worker's own queues
        (in ``keep``) the ends it uses (see :mod:`fastfeed.inherited_fds`)."""
        for queue in (self._results, *(worker.task_queue for worker in self.workers)):
            # The worker reads its task queue, and writes the results: the reading end it
            # keeps too, so that a write after the main process is gone is not an EPIPE
            # traceback from the queue's feeder thread.
            mine = queue in keep
            for end in unused_ends(queue, reading=not mine,
                             writing=not mine or queue is not self._results):
                inherited_fds.close_connection(end)
        for worker in self.workers:
            if worker.control is not None:
                worker.control.release_inherited()  # the main process's end
            for fd, file in worker.parent_ends.items():
                inherited_fds.close_if_same(fd, file)
        if self._lists is not None:
            self._lists.close()

    def shutdown(self, wait: bool = True, then: Callable[[], None] | None = None) -> None:
        """Ask the workers to exit, then join them (terminating any still busy after the
        grace), then call ``then``: nothing of theirs can write shared memory any more. With
        ``wait=False`` (from a finaliser) a reaper thread joins them instead, so that the
        thread the garbage collector happened to run in is never blocked."""
        self._shutting_down.set()
        workers = list(self.workers)
        try:
            for worker in workers:
                if worker.process.exitcode is None:
                    worker.send(Stop())
        finally:
            if wait:
                try:
                    stop_processes([w.process for w in workers], SHUTDOWN_GRACE, then)
                finally:
                    self._close(workers)
            else:
                # The reaper closes nothing: reference counting does, once it drops the
                # workers. The collector may already have finalised (closed) these pipes,
                # and closing one again could close an fd number reused since. It holds them
                # until their processes are gone: under spawn and forkserver a worker still
                # starting opens the queues' and the flag's semaphores by name, and those are
                # unlinked with their last reference here.
                threading.Thread(target=_reap, args=(workers, self._results, self._shutting_down,
                                                     then),
                                 name="fastfeed-reaper", daemon=True).start()

    def _close(self, workers: list[ProcessWorker]) -> None:
        for worker in workers:
            worker.task_queue.cancel_join_thread()
            worker.task_queue.close()
            if worker.control is not None:
                worker.control.close()
        self._results.cancel_join_thread()
        self._results.close()
        # The snapshot's descriptor is the loader's now: the next epoch may start from it.
