"""A pool of workers (processes that collate into the ring, or threads).

Dispatch and reordering follow torch's ``_MultiProcessingDataLoaderIter``: indices go to
workers round-robin, at most ``prefetch_factor`` tasks per worker are outstanding, results are
returned in sampler order (or as they arrive with ``in_order=False``), and IterableDataset
replicas are interleaved. What differs is what crosses the process boundary: each task carries
a ring slot, and the result is a small message that ``codec.decode`` turns back into tensors
that are views of that slot. With ``num_workers="auto"`` the pool also grows and shrinks.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader

from fastfeed.autotune import CpuMeter, Window, WorkerSleepMeter
from fastfeed.codec import Encoded, decode
from fastfeed.iterators.backends import make_backend
from fastfeed.iterators.base import BaseIterator
from fastfeed.iterators.setup import IteratorSetup
from fastfeed.iterators.workers import WorkerState, WorkerTable
from fastfeed.resume import LoaderState
from fastfeed.ring import SlotRing, Ticket
from fastfeed.worker import Produced, Resume, WorkerConfig, WorkerDone

__all__ = ["WorkerPoolIterator"]

# How often a waiting main process checks that its workers are alive.
_LIVENESS_INTERVAL = 0.1
# Beyond the slots of in-flight tasks: the batch being decoded and the one the user still holds.
_SPARE_SLOTS = 2
# A tuner window closes after this many batches or this many seconds (with at least
# _TUNER_MIN_BATCHES), so that short epochs and the first seconds of a run are tuned too.
_TUNER_WINDOW = 20
_TUNER_WINDOW_S = 0.5
_TUNER_MIN_BATCHES = 3

_python_exiting = False


def _mark_exiting() -> None:
    global _python_exiting
    _python_exiting = True


atexit.register(_mark_exiting)


def _reraise(wrapper: ExceptionWrapper) -> None:
    """Raise a worker's exception without a reference cycle.

    ``ExceptionWrapper.reraise`` keeps the exception in a local of the frame it raises from,
    so exception -> traceback -> that frame -> exception is a cycle, and every frame of the
    traceback (holding this iterator) would wait for the cyclic garbage collector: the
    workers would outlive the last reference to their iterator. Dropping that frame from the
    traceback breaks the cycle; the worker's own traceback is in the message.
    """
    try:
        wrapper.reraise()
    except BaseException as error:
        raise error.with_traceback(None)  # noqa: B904 - the same exception, not a new one


def _release_all(ring: SlotRing, tickets: list[Ticket]) -> None:
    for ticket in tickets:
        ring.release(ticket)


@dataclass
class _Task:
    """One index batch sent to a worker. It owns its slot's ticket until the batch is decoded
    (the ticket becomes the batch's lease) or the task ends otherwise (the ticket is
    released): :meth:`WorkerPoolIterator._settle` gives it back, or, for a task still in
    flight when the pool shuts down, :meth:`~WorkerPoolIterator._shutdown_workers` once the
    workers have exited."""

    worker_id: int
    ticket: Ticket | None
    result: Any = field(default=None)
    done: bool = False  # its result is in
    cancelled: bool = False  # its worker's replica ended first: it never runs
    dataset_state: Any = None


class WorkerPoolIterator(BaseIterator):
    """Iterates a FastLoader with worker processes or threads."""

    def __init__(self, loader: DataLoader, setup: IteratorSetup) -> None:
        super().__init__(loader, setup)
        assert loader.prefetch_factor is not None and loader.prefetch_factor > 0
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = loader.in_order
        # A forked child inherits this object; only the process that started the workers
        # may shut them down.
        self._owner_pid = os.getpid()
        self._shutdown = False
        self._shutdown_lock = threading.Lock()
        self._epoch = 0
        self._workers = WorkerTable()
        self._worker_init_fn = loader.worker_init_fn
        self._deterministic = setup.deterministic
        self._learned = setup.learned
        self._tuner = setup.tuner
        self._cpu = CpuMeter() if self._tuner is not None else None
        self._window = (time.perf_counter(), self._telemetry.waited)
        self._window_batches = 0

        self._backend = make_backend(setup.worker_mode, loader.multiprocessing_context)
        self._telemetry.worker_mode = self._backend.kind
        self._spare_slots = _SPARE_SLOTS + setup.held_by_prefetch
        self.ring = setup.ring if self._backend.kind == "process" else None
        self._telemetry.ring = self.ring
        try:
            for worker_id in range(self._num_workers):
                self._start_worker(worker_id, self._resume_dataset_state(self._resume, worker_id))
        except BaseException:
            self._shutdown_workers()
            raise
        self._size_ring()
        # Read as each tuner window closes (one /proc read per worker); the first reading is
        # now, so that the first window is measured too.
        self._sleep = (WorkerSleepMeter(self._worker_tasks()) if self._tuner is not None
                       else None)
        self._reset(loader, first_iter=True)

    @property
    def _max_tasks(self) -> int:
        return self._prefetch_factor * self._workers.serving

    def _size_ring(self) -> None:
        """Slots for every task in flight, plus the batches being decoded and held."""
        if self.ring is not None:
            fixed = self._setup.ring_slots
            self.ring.max_slots = (fixed if fixed is not None else
                                   self._max_tasks + self._spare_slots)

    def _start_worker(self, worker_id: int, dataset_state: Any = None,
                      num_workers: int | None = None) -> None:
        config = WorkerConfig(
            dataset=self._dataset,
            iterable=self._iterable,
            auto_collation=self._auto_collation,
            collate_fn=self._collate_fn,
            drop_last=self._drop_last,
            base_seed=self._base_seed,
            worker_init_fn=self._worker_init_fn,
            worker_id=worker_id,
            num_workers=num_workers or self._num_workers,
            dataset_state=dataset_state,
            thread=self._backend.kind == "thread",
            deterministic=self._deterministic,
        )
        self._workers.add(self._backend.start(config, self.ring))

    # -- epochs ------------------------------------------------------------------------------
    def _resume_dataset_state(self, resume: LoaderState | None, worker_id: int) -> Any:
        if resume is None or resume.dataset_states is None:
            return None
        if len(resume.dataset_states) != self._num_workers:
            raise ValueError(
                f"the loader state holds {len(resume.dataset_states)} IterableDataset replica "
                f"states but this loader has {self._num_workers} workers; resume with the "
                "same num_workers"
            )
        return resume.dataset_states[worker_id]

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        resume = self._epoch_resume
        if not first_iter:
            self._resume_workers(resume)
        self._epoch_clock = time.perf_counter()
        self._send_idx = 0
        self._rcvd_idx = 0
        self._tasks: dict[int, _Task] = {}
        self._tasks_outstanding = 0
        self._next_worker = 0  # round-robin position
        if resume is not None and resume.dataset_states is not None:
            # Continue the round robin where the snapshot left it.
            self._next_worker = resume.next_worker
            for worker_id, done in enumerate(resume.workers_done or []):
                if done:
                    self._workers.exhaust(worker_id, at=-1)
        for _ in range(self._max_tasks):
            self._try_put_index()

    def _resume_workers(self, resume: LoaderState | None) -> None:
        """Persistent workers: start the next epoch once every result of this one (finished
        or abandoned) is in."""
        self._epoch += 1
        resumed = self._workers.resumable()
        for worker_id in resumed:
            state = self._resume_dataset_state(resume, worker_id)
            self._workers[worker_id].handle.index_queue.put(Resume(self._epoch, state))
        # Each worker answers its tasks before its acknowledgement; a retiring worker gets no
        # Resume, so wait until it has answered its last task too.
        acknowledged = 0
        while acknowledged < len(resumed) or self._workers.retiring_owe():
            idx, result = self._get_result()
            if isinstance(idx, Resume):
                acknowledged += idx.epoch == self._epoch
            elif idx in self._tasks:
                self._answered(idx, result)
        for task in self._tasks.values():
            self._settle(task)  # results not delivered: their leases die with the tasks
        for worker_id in resumed:
            self._workers.resume(worker_id)

    # -- dispatch ----------------------------------------------------------------------------
    def _pick_worker(self) -> int | None:
        """The next active worker in round-robin order with room for a task, if any."""
        count = len(self._workers)
        active = self._workers.active_count()
        for _ in range(count):
            worker_id = self._next_worker % count
            self._next_worker = worker_id + 1
            worker = self._workers[worker_id]
            if worker.state is not WorkerState.ACTIVE:
                continue
            if self._in_order or worker.outstanding < self._max_tasks // active:
                return worker_id
        return None

    def _try_put_index(self) -> None:
        if self._tasks_outstanding >= self._max_tasks:
            return
        try:
            index = self._next_index()
        except StopIteration:
            return
        worker_id = self._pick_worker()
        if worker_id is None:
            return
        ticket = self._acquire_ticket()
        slot_id = None if ticket is None else ticket.slot_id
        self._workers[worker_id].handle.index_queue.put((self._send_idx, index, slot_id))
        self._tasks[self._send_idx] = _Task(worker_id, ticket)
        self._workers.assign(worker_id)
        self._tasks_outstanding += 1
        self._send_idx += 1

    def _acquire_ticket(self) -> Ticket | None:
        if self.ring is None:
            return None
        ticket, created, retired = self.ring.acquire()
        self._announce(created, retired)
        return ticket

    def _announce(self, created: list, retired: list[int]) -> None:
        if created or retired:
            for worker in self._workers.mapping_slots():
                self._backend.announce(worker.handle, created, retired)

    def _settle(self, task: _Task, result: Encoded | None = None) -> Any:
        """End the task's hold on its slot, exactly once: lease it to ``result``'s batch, or
        give it back. Returns the decoded batch."""
        ticket, task.ticket = task.ticket, None
        lease = None
        if ticket is not None:
            assert self.ring is not None
            if result is not None and result.slot_id == ticket.slot_id:
                lease = self.ring.lease(ticket)
            else:
                self.ring.release(ticket)
        elif result is not None and result.private_slot is not None:
            assert self.ring is not None
            lease, created = self.ring.adopt(result.private_slot.detach())
            self._announce(created, [])
        return None if result is None else decode(result, lease)

    # -- receive -----------------------------------------------------------------------------
    def _get_result(self) -> tuple[Any, Any]:
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            wait = _LIVENESS_INTERVAL
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            try:
                return self._backend.result_queue.get(timeout=wait)
            except queue.Empty:
                pass
            self._check_workers()
            if deadline is not None and time.monotonic() >= deadline:
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")

    def _check_workers(self, wait: float = 0.0) -> None:
        """Raise if a worker that should be running has died, waiting up to ``wait`` s for
        one that is dying."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and all(
            w.handle.exit_reason() is None for w in self._workers
        ):
            time.sleep(0.02)
        for worker in self._workers:
            reason = worker.handle.exit_reason()
            # Stopped workers exit normally: only once every task of theirs was answered.
            if reason is not None and worker.state is not WorkerState.STOPPED:
                handle = worker.handle
                message = (f"DataLoader worker {handle.worker_id} (pid {handle.pid}) exited "
                           f"unexpectedly: {reason}")
                self._shutdown_workers()
                raise RuntimeError(message)

    def _next_data(self) -> Any:
        while True:
            while self._rcvd_idx < self._send_idx:
                task = self._tasks.get(self._rcvd_idx)
                if task is not None and not task.cancelled:
                    break
                self._tasks.pop(self._rcvd_idx, None)
                self._rcvd_idx += 1
            else:
                self._epoch_finished()
                raise StopIteration

            task = self._tasks[self._rcvd_idx]
            if task.done:
                del self._tasks[self._rcvd_idx]
                self._rcvd_idx += 1
                return self._process(task)

            assert not self._shutdown and self._tasks_outstanding > 0
            idx, result = self._get_result()
            arrived = self._answered(idx, result)
            if arrived.cancelled:  # the replica of its worker ended
                self._try_put_index()
                continue
            if idx == self._rcvd_idx or not self._in_order:
                del self._tasks[idx]
                if idx == self._rcvd_idx:
                    self._rcvd_idx += 1
                return self._process(arrived)

    def _epoch_finished(self) -> None:
        if self._num_yielded:
            rate = self._num_yielded / max(time.perf_counter() - self._epoch_clock, 1e-9)
            self._learned.epoch_rates.setdefault(self._backend.kind, rate)
        if not self._persistent_workers:
            self._shutdown_workers()

    def _answered(self, idx: int, result: Any) -> _Task:
        """Book a worker's answer to task ``idx`` and decode it at once: shared memory sent
        outside the ring is fetched from the worker, which may exit (an exhausted
        IterableDataset replica) before this batch's turn comes."""
        task = self._tasks[idx]
        self._tasks_outstanding -= 1
        if isinstance(result, WorkerDone):
            self._workers.answered(task.worker_id)
            self._replica_ended(idx, task)
            return task
        try:
            self._receive(task, result)
        finally:
            if self._workers.answered(task.worker_id):
                self._stop_worker(task.worker_id)  # a retiring worker's last task: it may exit
        return task

    def _replica_ended(self, idx: int, task: _Task) -> None:
        """The worker's IterableDataset replica ended at task ``idx``: that task and the later
        ones sent to the same worker never run. Cancel them, as torch skips them."""
        worker_id = task.worker_id
        for other in self._tasks.values():
            if other.worker_id == worker_id and not other.done and not other.cancelled:
                other.cancelled = True
                self._settle(other)
                if other is not task:
                    self._tasks_outstanding -= 1
                    self._workers.answered(worker_id)
        self._workers.exhaust(worker_id, at=idx)
        if not self._persistent_workers:
            self._stop_worker(worker_id)

    def _receive(self, task: _Task, result: Any) -> None:
        task.done = True
        if not isinstance(result, Produced):
            self._settle(task)
            task.result = result
            return
        task.dataset_state = result.dataset_state
        self._telemetry.skipped += result.skipped
        self._telemetry.add_stage("fetch", result.fetch_s)
        self._telemetry.add_stage("collate", result.collate_s)
        self._telemetry.add_worker_busy(result.fetch_s + result.collate_s)
        if not isinstance(result.batch, Encoded):  # from a thread: the batch itself
            task.result = result.batch
            return
        if self.ring is not None:
            self.ring.note_required(result.batch.required)
        try:
            task.result = self._settle(task, result.batch)  # the batch holds the slot's lease
        except Exception as error:
            if isinstance(error, (OSError, EOFError)):
                # Shared memory outside the ring is fetched from its worker: if that worker
                # died, say so rather than surface a socket error.
                self._check_workers(wait=2.0)
            # Raised in the batch's turn, as a worker's exception would be (the task is done:
            # leaving it without a result would hand the user None there).
            task.result = ExceptionWrapper(
                where=f"in the main process, rebuilding a batch of worker {task.worker_id}")

    def _process(self, task: _Task) -> Any:
        self._try_put_index()
        if isinstance(task.result, ExceptionWrapper):
            _reraise(task.result)
        if task.dataset_state is not None:
            self._dataset_states[task.worker_id] = task.dataset_state
        return self._pin(task.result)

    def state_dict(self) -> LoaderState:
        if not self._in_order and self._num_yielded and not self._exhausted:
            # Out of order, the delivered batches are not the first N of the sampler: a count
            # cannot say which they were.
            raise RuntimeError("a mid-epoch state_dict() needs in_order=True (with "
                               "in_order=False, batches arrive out of sampler order)")
        return super().state_dict()

    def _round_robin_position(self) -> dict[str, Any]:
        if not self._iterable:
            return {}
        pending = [idx for idx, task in self._tasks.items()
                   if idx >= self._rcvd_idx and not task.cancelled]
        upcoming = min(pending, default=self._send_idx)
        return {
            "next_worker": self._tasks[upcoming].worker_id if pending else 0,
            "workers_done": [w.exhausted_at is not None and w.exhausted_at < upcoming
                             for w in self._workers],
        }

    # -- auto-tuning -------------------------------------------------------------------------
    def _delivered(self) -> None:
        if self._tuner is None:
            return
        self._window_batches += 1
        now, waited = time.perf_counter(), self._telemetry.waited
        start, start_waited = self._window
        long_enough = (self._window_batches >= _TUNER_MIN_BATCHES
                       and now - start >= _TUNER_WINDOW_S)
        if self._window_batches < _TUNER_WINDOW and not long_enough:
            return
        self._window = (now, waited)
        batches, self._window_batches = self._window_batches, 0
        elapsed = now - start
        if elapsed <= 0:
            return
        assert self._cpu is not None and self._sleep is not None
        window = Window(batches / elapsed, min(1.0, (waited - start_waited) / elapsed),
                        self._cpu.idle_cores(), self._sleep.sleep_fraction(self._worker_tasks()))
        wanted = self._tuner.observe(window)
        if wanted != self._workers.serving:
            self._telemetry.decision(self._tuner.log[-1])
            self._resize(wanted)

    def _worker_tasks(self) -> list[int]:
        """The kernel tasks of the workers that take tasks, for the sleep meter: a retiring
        worker is winding down, and an exited one has nothing left to read."""
        return [task for w in self._workers
                if w.state is WorkerState.ACTIVE and (task := w.handle.task_id) is not None]

    def _resize(self, wanted: int) -> None:
        while self._workers.serving < wanted:
            self._start_worker(len(self._workers), num_workers=self._workers.serving + 1)
        while self._workers.serving > wanted:
            # The newest active worker gets no more tasks, and exits once the main process
            # has received its last batch: a batch outside the ring is fetched from the
            # worker that made it, which must still be alive then.
            worker_id = self._workers.newest_serving()
            if self._workers.retire(worker_id):
                self._stop_worker(worker_id)
        self._size_ring()
        self._learned.workers = self._workers.serving  # where the next epoch's workers start
        for _ in range(self._max_tasks):
            self._try_put_index()

    # -- shutdown ----------------------------------------------------------------------------
    def _stop_worker(self, worker_id: int) -> None:
        self._workers.stop(worker_id)
        self._workers[worker_id].handle.index_queue.put(None)

    def _shutdown_workers(self, wait: bool = True) -> None:
        # Once, from whichever thread gets here first: __del__ can run in any thread that
        # happens to trigger garbage collection. The ring is the loader's: it outlives this.
        if _python_exiting or os.getpid() != self._owner_pid:
            return
        if not self._shutdown_lock.acquire(blocking=False):
            return
        self._shutdown = True
        # Tasks still in flight (a break, an error) hand their tickets over: they go back to
        # the loader's ring once no worker can write the slots any more.
        tickets = []
        for task in getattr(self, "_tasks", {}).values():
            ticket, task.ticket = task.ticket, None
            if ticket is not None:
                tickets.append(ticket)
        release = None
        if tickets and self.ring is not None:
            release = partial(_release_all, self.ring, tickets)
        self._backend.shutdown([w.handle for w in self._workers], wait=wait, then=release)

    def close(self) -> None:
        self._shutdown_workers()

    def __del__(self) -> None:
        if hasattr(self, "_shutdown_lock"):
            self._shutdown_workers(wait=False)
