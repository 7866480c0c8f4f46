"""The pool's workers as one object: starting, feeding, hearing from and stopping them.

The pool iterator decides *what* to send (which task, to which worker) and what each answer
means. The crew knows *how*: it reaches each worker through the backend (processes, threads
or Ray actors: :mod:`fastfeed.backends`), tells workers of the pool's slots, starts
persistent workers' next epoch, grows and shrinks the pool for the tuner, and shuts
everything down exactly once, from whichever thread gets there first. A worker that is gone
when it should not be shuts the pool down and raises.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from fastfeed.backends import WorkerBackend, WorkerExited
from fastfeed.iterators.liveness import next_answer, raise_if_a_worker_died
from fastfeed.iterators.tasks import TaskBook
from fastfeed.iterators.workers import WorkerTable
from fastfeed.protocol import (
    Answer,
    EpochStarted,
    SlotAdded,
    StartEpoch,
    Stop,
    Task,
    WorkerConfig,
)
from fastfeed.slots import Lease, SlotPool, Ticket

__all__ = ["WorkerCrew"]

_python_exiting = False


def _mark_exiting() -> None:
    global _python_exiting
    _python_exiting = True


# At interpreter exit the workers are daemons that multiprocessing terminates itself; queues
# and threads may already be gone, so a late finaliser must not touch them.
atexit.register(_mark_exiting)


def _release_all(slot_pool: SlotPool, tickets: list[Ticket]) -> None:
    for ticket in tickets:
        slot_pool.release(ticket)


class WorkerCrew:
    """The workers of one pool iterator.

    Args:
        backend: starts the workers and owns what they share with this process.
        book: the pool's task book, from which the worker table reads what each worker owes.
        slot_pool: the loader's, whose slots the backend's workers write (None: no slot pool).
        timeout: the loader's ``timeout`` for each message, 0 for none.
    """

    def __init__(self, backend: WorkerBackend, book: TaskBook, slot_pool: SlotPool | None,
                 timeout: float) -> None:
        self.table = WorkerTable(book)
        self.backend_name = backend.name
        self._backend = backend
        self._book = book
        self._slot_pool = slot_pool
        self._timeout = timeout
        # A forked child inherits this object; only the process that started the workers
        # may shut them down.
        self._owner_pid = os.getpid()
        self._shutdown_lock = threading.Lock()
        self.closed = False  # shut down: a next epoch needs new workers
        # Set while another thread gives up this crew's waits (see BaseIterator).
        self.interrupt = threading.Event()

    def start(self, config: WorkerConfig) -> None:
        self.table.add(self._backend.start(config))

    def rebuild(self, batch: Any, lease: Lease | None) -> Any:
        """An answer's batch as the consumer gets it (see the backend's ``rebuild``)."""
        return self._backend.rebuild(batch, lease)

    def send(self, worker_id: int, message: Task | StartEpoch) -> None:
        self.table[worker_id].handle.send(message)

    def stop(self, worker_id: int) -> None:
        """Let a worker that owes nothing exit."""
        self.table.stop(worker_id)
        self.table[worker_id].handle.send(Stop())

    def announce(self, created: list[SlotAdded], retired: list[int]) -> None:
        """Tell every worker that maps slots of the slots the slot pool created and dropped."""
        if created or retired:
            for worker in self.table.mapping_slots():
                worker.handle.announce_slots(created, retired)
            if self._slot_pool is not None:
                self._slot_pool.announced(created)

    # -- hearing from the workers ------------------------------------------------------------
    def next_answer(self) -> Answer | EpochStarted:
        """The next message from any worker.

        Raises:
            RuntimeError: a worker died (the pool is shut down), or ``timeout`` passed.
        """
        try:
            return next_answer(self._backend, self.table, self._timeout, self.interrupt)
        except WorkerExited:
            self.shutdown()
            raise

    def raise_if_a_worker_died(self, wait: float = 0.0) -> None:
        try:
            raise_if_a_worker_died(self.table, wait)
        except WorkerExited:
            self.shutdown()
            raise

    def start_epoch(self, epoch: int, dataset_state: Callable[[int], Any],
                    receive: Callable[[Answer], None]) -> None:
        """Start persistent workers' epoch ``epoch`` once every answer of the last one is in
        (each goes to ``receive``); ``dataset_state(worker_id)`` is the replica state to
        resume from, or None."""
        resumed = self.table.resumable()
        for worker_id in resumed:
            self.send(worker_id, StartEpoch(epoch, dataset_state(worker_id)))
        # Each worker answers its tasks before its acknowledgement; a retiring worker gets no
        # StartEpoch, so wait until it has answered its last task too.
        acknowledged = 0
        while acknowledged < len(resumed) or self.table.retiring_with_tasks():
            message = self.next_answer()
            if isinstance(message, EpochStarted):
                acknowledged += message.epoch == epoch
            else:
                receive(message)
        for worker_id in resumed:
            self.table.resume(worker_id)

    # -- the tuner's pool size -----------------------------------------------------------------
    def resize(self, wanted: int, config: Callable[[int, int], WorkerConfig]) -> None:
        """Grow or shrink the serving workers to ``wanted``; ``config(worker_id, num_workers)``
        describes a new one."""
        while self.table.serving < wanted:
            self.start(config(len(self.table), self.table.serving + 1))
        while self.table.serving > wanted:
            # The newest worker gets no more tasks, and exits once the main process has
            # received its last batch: a batch outside the slot pool is fetched from the worker
            # that made it, which must still be alive then.
            worker_id = self.table.newest_serving()
            if self.table.retire(worker_id):
                self.stop(worker_id)

    # -- shutdown ------------------------------------------------------------------------------
    def shutdown(self, wait: bool = True) -> None:
        """Stop every worker, once. Tasks still in flight (a break, an error) hand their
        tickets back to the slot pool once no worker can write their slots any more.

        With ``wait=False`` (from a finaliser, in whatever thread the garbage collector runs)
        the joins happen on a reaper thread.
        """
        if _python_exiting or os.getpid() != self._owner_pid:
            return
        if not self._shutdown_lock.acquire(blocking=False):
            return
        self.closed = True
        tickets = self._book.take_tickets()
        release = None
        if tickets and self._slot_pool is not None:
            release = partial(_release_all, self._slot_pool, tickets)
        self._backend.shutdown(wait=wait, then=release)
