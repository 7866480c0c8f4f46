"""The worker pool's iterator: dispatch tasks, receive answers, deliver batches.

Dispatch and ordering follow torch's ``_MultiProcessingDataLoaderIter``: indices go to
workers round-robin, at most ``prefetch_factor`` tasks per worker are outstanding, batches
are delivered in sampler order (or as they arrive with ``in_order=False``), and
IterableDataset replicas are interleaved. What crosses the process boundary differs: each task
carries a pool slot, and the answer is a small message that ``codec.decode`` turns back into
tensors that are views of that slot (see :mod:`fastfeed.protocol`). The task book
(:mod:`~fastfeed.iterators.tasks`) keeps every task's state; the crew
(:mod:`~fastfeed.iterators.crew`) starts, reaches and stops the workers.
"""

from __future__ import annotations

import contextlib
import operator
import time
import weakref
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from fastfeed._torch_compat import ExceptionWrapper
from fastfeed.autotune import TuningWindows
from fastfeed.iterators.base_iterator import BaseIterator, HostBatch
from fastfeed.iterators.crew import WorkerCrew
from fastfeed.iterators.host_plan import HostPlan
from fastfeed.iterators.tasks import Entry, TaskBook
from fastfeed.protocol import Answer, Encoded, Failed, Produced, ReplicaEnded, Shipped, Task
from fastfeed.slots import Lease, Ticket, slot_budget

__all__ = ["WorkerPoolIterator"]


def _reraise(wrapper: ExceptionWrapper) -> None:
    """Raise a worker's exception without a reference cycle.

    ``ExceptionWrapper.reraise`` keeps the exception in a local of the frame it raises from,
    so exception -> traceback -> that frame -> exception is a cycle, and every frame of the
    traceback (holding this iterator) would wait for the cyclic garbage collector: the
    workers would outlive the last reference to their iterator. Raising it afresh without
    that frame breaks the cycle; the worker's own traceback is in the message.
    """
    try:
        wrapper.reraise()
    except BaseException as error:
        raise error.with_traceback(None) from error.__cause__


class WorkerPoolIterator(BaseIterator):
    """Iterates a FastLoader with worker processes or threads."""

    def __init__(self, loader: DataLoader, plan: HostPlan) -> None:
        operator.index(loader.num_workers)  # torch's TypeError for num_workers=2.0
        super().__init__(loader, plan)
        if loader.prefetch_factor is None:
            raise TypeError("prefetch_factor is None with num_workers > 0: num_workers was set "
                            "after the loader was built without workers; build it with its "
                            "num_workers, or set prefetch_factor too")
        if loader.prefetch_factor <= 0:  # torch's own check and message
            raise AssertionError(
                "prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter")
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = loader.in_order
        self._epoch = 0
        self._book = TaskBook()
        self.slot_pool = plan.slot_pool  # for the backends whose batches use one
        assert plan.backend is not None  # planned for workers
        backend = plan.backend(plan.backend_args)
        self._crew = WorkerCrew(backend, self._book, self.slot_pool, self._timeout)
        # Dropped without close() (a break, an error, an abandoned epoch), the iterator's
        # workers are stopped by a finaliser that holds the crew, not by __del__: collected
        # in a reference cycle, a __del__ would hand queues the collector has already
        # condemned to new feeder threads, and the collector would then close their pipes
        # under those threads, which later close the same fd numbers, reused by then.
        dropped = weakref.finalize(self, self._crew.shutdown, False)
        dropped.atexit = False
        self._table = self._crew.table
        self._telemetry.serving(backend.name, self.slot_pool)
        try:
            for worker_id in range(self._num_workers):
                self._crew.start(self._worker_config(
                    worker_id, dataset_state=self._replica_state(self._resume, worker_id)))
        except BaseException:
            self._crew.shutdown()
            raise
        if self.slot_pool is not None and self._persistent_workers and plan.tuner is None:
            self.slot_pool.seal()  # these workers are the last to map its slots
        self._size_slot_pool()
        self._tuning = (None if plan.tuner is None else TuningWindows(
            plan.tuner, self._table.active_tasks(), self._telemetry.waited,
            self._telemetry.worker_busy_s))
        self._reset(loader, first_iter=True)

    @property
    def _max_tasks(self) -> int:
        return self._prefetch_factor * self._table.serving

    def _size_slot_pool(self) -> None:
        if self.slot_pool is not None:
            self.slot_pool.max_slots = slot_budget(self._max_tasks, self._plan.held_batches,
                                                   self._plan.slot_cap)

    @property
    def closed(self) -> bool:
        """Whether the workers were shut down (a worker died): the next epoch needs new ones."""
        return self._crew.closed

    # -- epochs ------------------------------------------------------------------------------
    def _start_epoch(self, loader: DataLoader, first_iter: bool) -> None:
        super()._start_epoch(loader, first_iter)
        resume = self._epoch_resume
        if not first_iter:  # persistent workers: every answer of the last epoch first
            self._epoch += 1
            self._crew.start_epoch(self._epoch, lambda w: self._replica_state(resume, w),
                                   self._receive)  # batches not delivered die with their leases
        self._epoch_clock = time.perf_counter()
        self._book.start_epoch()
        self._table.next_worker = 0  # round-robin position
        if resume is not None and resume.dataset_states is not None:
            # Continue the round robin where the snapshot left it.
            self._table.next_worker = resume.next_worker
            for worker_id, done in enumerate(resume.workers_done or []):
                if done:
                    self._table.exhaust(worker_id, at=-1)
        self._fill()

    def _epoch_finished(self) -> None:
        if self._num_yielded:
            rate = self._num_yielded / max(time.perf_counter() - self._epoch_clock, 1e-9)
            self._plan.carry_over.epoch_rates.setdefault(self._crew.backend_name, rate)
        if not self._persistent_workers:
            self._crew.shutdown()

    # -- dispatch ----------------------------------------------------------------------------
    def _fill(self) -> None:
        for _ in range(self._max_tasks):
            self._send_next()

    def _send_next(self) -> None:
        if self._book.outstanding() >= self._max_tasks:
            return
        try:
            index = self._next_index()
        except StopIteration:
            return
        # In order, torch gives the next worker its task whatever it owes; out of order, only
        # a worker with room (its share of the tasks in flight).
        worker_id = self._table.pick(None if self._in_order else self._max_tasks)
        if worker_id is None:
            return
        ticket = None
        if self.slot_pool is not None:
            ticket, created, retired = self.slot_pool.acquire()
            self._crew.announce(created, retired)
        seq = self._book.send(worker_id, ticket)
        self._crew.send(worker_id, Task(seq, index, None if ticket is None else ticket.slot_id))

    # -- receive -----------------------------------------------------------------------------
    def _receive(self, answer: Answer) -> None:
        """Book a worker's answer and decode its batch at once: shared memory sent outside the
        slot pool is fetched from the worker, which may exit (an exhausted IterableDataset replica)
        before this batch's turn comes."""
        outcome = answer.outcome
        worker_id = self._book[answer.seq].worker_id
        if isinstance(outcome, ReplicaEnded):
            # The tasks queued behind this one never run: cancel them, as torch skips them.
            for cancelled in self._book.cancel_worker(worker_id):
                self._settle(cancelled.take_ticket())
            self._table.exhaust(worker_id, at=answer.seq)
            if not self._persistent_workers:
                self._crew.stop(worker_id)
            return
        entry = self._book.answer(answer.seq)
        try:
            entry.result = self._result_of(entry, outcome)
        finally:
            if self._table.may_stop(worker_id):
                self._crew.stop(worker_id)  # a retiring worker's last task: it may exit

    def _result_of(self, entry: Entry, outcome: Produced | Failed) -> HostBatch | ExceptionWrapper:
        """What the consumer gets in the task's turn: its batch, or the error to raise."""
        ticket = entry.take_ticket()
        if isinstance(outcome, Failed):
            self._settle(ticket)
            return outcome.error
        entry.dataset_state = outcome.dataset_state
        self._telemetry.record_produced(outcome)
        message = outcome.batch  # in a slot (Encoded, Shipped), or the batch itself
        try:
            lease = None
            if self.slot_pool is not None:
                self.slot_pool.fit_batches_of(message.required)
                lease = self._settle(ticket, message)
            return HostBatch(self._crew.rebuild(message, lease), lease)
        except Exception as error:
            if isinstance(error, (OSError, EOFError)):
                # Shared memory outside the slot pool is fetched from its worker: if that worker
                # died, say so rather than surface a socket error.
                self._crew.raise_if_a_worker_died(wait=2.0)
            # Raised in the batch's turn, as a worker's exception would be.
            return ExceptionWrapper(
                where=f"in the main process, rebuilding a batch of worker {entry.worker_id}")

    def _settle(self, ticket: Ticket | None, batch: Encoded | Shipped | None = None
                ) -> Lease | None:
        """The one place a task's hold on a slot ends: its ticket becomes ``batch``'s lease,
        or goes back to the slot pool; a batch sent without one is leased the slot its worker
        made (adopted into the slot pool when it fits)."""
        if ticket is not None:
            assert self.slot_pool is not None
            if batch is not None:  # written into the ticket's slot (the protocol's rule)
                return self.slot_pool.lease(ticket)
            self.slot_pool.release(ticket)
        elif batch is not None and batch.private_slot is not None:
            assert self.slot_pool is not None
            lease, created = self.slot_pool.adopt(batch.private_slot.detach())
            self._crew.announce(created, [])
            return lease
        return None

    # -- deliver -----------------------------------------------------------------------------
    def _next_data(self) -> HostBatch:
        while True:
            entry = self._book.deliver(self._in_order)
            if entry is not None:
                self._send_next()
                if isinstance(entry.result, ExceptionWrapper):
                    _reraise(entry.result)
                if entry.dataset_state is not None:
                    self._dataset_states[entry.worker_id] = entry.dataset_state
                batch, lease = entry.result
                return HostBatch(batch, lease)
            if self._book.finished:
                self._epoch_finished()
                raise StopIteration
            assert not self._crew.closed and self._book.outstanding() > 0
            answer = self._crew.next_answer()
            assert isinstance(answer, Answer), answer  # acknowledgements come as epochs start
            self._receive(answer)
            if isinstance(answer.outcome, ReplicaEnded):
                self._send_next()  # in the place of the cancelled tasks

    def _round_robin_position(self) -> dict[str, Any]:
        position: dict[str, Any] = {"out_of_order": not self._in_order}
        if self._iterable:
            upcoming, worker_id = self._book.upcoming()
            position["next_worker"] = worker_id or 0
            position["workers_done"] = tuple(
                w.exhausted_at is not None and w.exhausted_at < upcoming for w in self._table)
        return position

    # -- auto-tuning -------------------------------------------------------------------------
    def _after_delivery(self) -> None:
        if self._tuning is None:
            return
        wanted = self._tuning.delivered(self._telemetry.waited, self._table.active_tasks(),
                                        self._telemetry.worker_busy_s)
        if wanted is not None and wanted != self._table.serving:
            self._telemetry.decision(self._tuning.tuner.log[-1])
            self._crew.resize(wanted, lambda worker_id, num_workers: self._worker_config(
                worker_id, num_workers=num_workers))
            self._size_slot_pool()
            self._plan.carry_over.workers = self._table.serving  # where the next epoch starts
            self._fill()

    @contextlib.contextmanager
    def waits_interrupted(self) -> Iterator[None]:
        self._crew.interrupt.set()
        try:
            yield
        finally:
            self._crew.interrupt.clear()

    # -- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        self._crew.shutdown()

    # What frameworks reach for on torch's iterator: Ultralytics' InfiniteDataLoader.close()
    # terminates the processes in ``_workers`` that are alive, then calls _shutdown_workers().
    @property
    def _workers(self) -> list[Any]:
        """The worker processes, as torch's iterator lists them (none for other backends)."""
        return [w.handle.process for w in self._table if w.handle.process is not None]

    def _shutdown_workers(self) -> None:
        self._crew.shutdown()
