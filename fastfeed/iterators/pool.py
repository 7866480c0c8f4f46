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
from typing import Any

from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader

from fastfeed.autotune import CpuMeter, Window
from fastfeed.codec import Encoded, decode
from fastfeed.iterators.backends import WorkerHandle, make_backend
from fastfeed.iterators.base import BaseIterator
from fastfeed.iterators.setup import IteratorSetup
from fastfeed.resume import LoaderState
from fastfeed.ring import SlotRing, ring_supported
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


@dataclass
class _Task:
    worker_id: int
    slot_id: int | None
    result: Any = field(default=None)
    done: bool = False
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
        self._workers: list[WorkerHandle] = []
        self._retired: set[int] = set()  # retired by the tuner; their ids are never reused
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
        slots = setup.ring_slots
        self._fixed_ring_size = slots is not None
        use_ring = self._backend.kind == "process" and ring_supported() and slots != 0
        self._ring = (
            SlotRing(slots if slots is not None else self._max_slots(self._num_workers),
                     pin=setup.pin_ring, slot_bytes=self._learned.ring_slot_bytes)
            if use_ring else None
        )
        self._telemetry.ring = self._ring
        try:
            for worker_id in range(self._num_workers):
                self._start_worker(worker_id, self._resume_dataset_state(self._resume, worker_id))
        except BaseException:
            self._shutdown_workers()
            raise
        self._reset(loader, first_iter=True)

    @property
    def _active(self) -> int:
        return len(self._workers) - len(self._retired)

    @property
    def _max_tasks(self) -> int:
        return self._prefetch_factor * self._active

    def _max_slots(self, workers: int) -> int:
        return self._prefetch_factor * workers + self._spare_slots

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
        self._workers.append(self._backend.start(config, self._ring))

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
        live = [w.worker_id for w in self._workers if w.worker_id not in self._retired]
        if not first_iter:
            self._epoch += 1
            self._workers_status = [w in live for w in range(len(self._workers))]
            for worker_id in live:
                state = self._resume_dataset_state(resume, worker_id)
                self._workers[worker_id].index_queue.put(Resume(self._epoch, state))
            # Results of the abandoned epoch arrive before each worker's acknowledgement.
            acknowledged = 0
            while acknowledged < len(live):
                idx, result = self._get_result()
                if isinstance(idx, Resume):
                    acknowledged += idx.epoch == self._epoch
                elif idx in self._tasks:
                    self._receive(self._tasks[idx], result)
            for task in self._tasks.values():
                if not task.done:
                    self._release(task.slot_id)
            for worker_id in self._retired:  # every result of theirs is in by now
                self._stop_worker(worker_id)
        self._epoch_clock = time.perf_counter()
        self._send_idx = 0
        self._rcvd_idx = 0
        self._tasks: dict[int, _Task] = {}
        self._tasks_outstanding = 0
        self._workers_status = [w in live for w in range(len(self._workers))]
        self._workers_num_tasks = [0] * len(self._workers)
        self._next_worker = 0  # round-robin position
        self._done_at: dict[int, int] = {}  # worker id -> task index its replica ended at
        if resume is not None and resume.dataset_states is not None:
            # Continue the round robin where the snapshot left it.
            self._next_worker = resume.next_worker
            for worker_id, done in enumerate(resume.workers_done or []):
                self._workers_status[worker_id] = not done
        for _ in range(self._max_tasks):
            self._try_put_index()

    # -- dispatch ----------------------------------------------------------------------------
    def _pick_worker(self) -> int | None:
        """The next active worker in round-robin order with room for a task, if any."""
        count = len(self._workers)
        for _ in range(count):
            worker_id = self._next_worker % count
            self._next_worker = worker_id + 1
            if not self._workers_status[worker_id]:
                continue
            if self._in_order:
                return worker_id
            if self._workers_num_tasks[worker_id] < self._max_tasks // sum(self._workers_status):
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
        slot_id = self._acquire_slot()
        self._workers[worker_id].index_queue.put((self._send_idx, index, slot_id))
        self._tasks[self._send_idx] = _Task(worker_id, slot_id)
        self._workers_num_tasks[worker_id] += 1
        self._tasks_outstanding += 1
        self._send_idx += 1

    def _acquire_slot(self) -> int | None:
        if self._ring is None:
            return None
        slot, created, retired = self._ring.acquire()
        if created or retired:
            for handle in self._workers:
                if handle.worker_id not in self._retired:
                    self._backend.announce(handle, created, retired)
        return None if slot is None else slot.slot_id

    def _release(self, slot_id: int | None) -> None:
        if slot_id is not None and self._ring is not None:
            self._ring.release(slot_id)

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
        """Raise if an active worker has died, waiting up to ``wait`` s for one that is dying."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and all(
            h.exit_reason() is None for h in self._workers
        ):
            time.sleep(0.02)
        for handle in self._workers:
            reason = handle.exit_reason()
            # A retired worker exits normally, but only once its queued tasks are done.
            expected = (self._workers_status[handle.worker_id]
                        or self._workers_num_tasks[handle.worker_id] > 0)
            if expected and reason is not None:
                message = (f"DataLoader worker {handle.worker_id} (pid {handle.pid}) exited "
                           f"unexpectedly: {reason}")
                self._shutdown_workers()
                raise RuntimeError(message)

    def _next_data(self) -> Any:
        while True:
            while self._rcvd_idx < self._send_idx:
                task = self._tasks.get(self._rcvd_idx)
                if task is not None:
                    if task.done or task.worker_id not in self._done_at:
                        break
                    # its worker's IterableDataset replica ended; the task never ran
                    self._release(self._tasks.pop(self._rcvd_idx).slot_id)
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
            self._tasks_outstanding -= 1
            arrived = self._tasks[idx]
            if isinstance(result, WorkerDone):
                self._release(arrived.slot_id)
                self._done_at[result.worker_id] = idx
                if self._persistent_workers:
                    self._workers_status[result.worker_id] = False
                else:
                    self._stop_worker(result.worker_id)
                self._try_put_index()
                continue
            self._receive(arrived, result)
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

    def _receive(self, task: _Task, result: Any) -> None:
        # Decode at once: shared memory sent outside the ring is fetched from the worker, which
        # may exit (an exhausted IterableDataset replica) before this batch's turn comes.
        task.done = True
        if not isinstance(result, Produced):
            self._release(task.slot_id)
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
        if self._ring is not None:
            self._ring.note_required(result.batch.required)
        try:
            task.result = decode(result.batch, self._ring)  # the batch holds the slot's lease
        except (OSError, EOFError):
            # Shared memory outside the ring is fetched from its worker: if that worker died,
            # say so rather than surface a socket error.
            self._release(task.slot_id)
            self._check_workers(wait=2.0)
            raise

    def _process(self, task: _Task) -> Any:
        self._workers_num_tasks[task.worker_id] -= 1
        if task.worker_id in self._retired and not self._workers_num_tasks[task.worker_id]:
            self._stop_worker(task.worker_id)  # its last batch is in: it may exit now
        self._try_put_index()
        if isinstance(task.result, ExceptionWrapper):
            _reraise(task.result)
        if task.dataset_state is not None:
            self._dataset_states[task.worker_id] = task.dataset_state
        return self._pin(task.result)

    def _round_robin_position(self) -> dict[str, Any]:
        if not self._iterable:
            return {}
        pending = [idx for idx in self._tasks if idx >= self._rcvd_idx]
        upcoming = min(pending, default=self._send_idx)
        return {
            "next_worker": self._tasks[upcoming].worker_id if pending else 0,
            "workers_done": [self._done_at.get(w, upcoming) < upcoming
                             for w in range(len(self._workers))],
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
        assert self._cpu is not None
        window = Window(batches / elapsed, min(1.0, (waited - start_waited) / elapsed),
                        self._cpu.idle_cores())
        wanted = self._tuner.observe(window)
        if wanted != self._active:
            self._telemetry.decision(self._tuner.log[-1])
            self._resize(wanted)

    def _resize(self, wanted: int) -> None:
        while self._active < wanted:
            self._start_worker(len(self._workers), num_workers=self._active + 1)
            self._workers_status.append(True)
            self._workers_num_tasks.append(0)
        while self._active > wanted:
            # The newest active worker gets no more tasks, and exits once the main process
            # has received its last batch: a batch outside the ring is fetched from the
            # worker that made it, which must still be alive then.
            worker_id = max(set(range(len(self._workers))) - self._retired)
            self._retired.add(worker_id)
            self._workers_status[worker_id] = False
            if not self._workers_num_tasks[worker_id]:
                self._stop_worker(worker_id)
        if self._ring is not None and not self._fixed_ring_size:
            self._ring.max_slots = self._max_slots(self._active)
        self._learned.workers = self._active  # where the next epoch's workers start
        for _ in range(self._max_tasks):
            self._try_put_index()

    # -- shutdown ----------------------------------------------------------------------------
    def _stop_worker(self, worker_id: int) -> None:
        self._workers[worker_id].index_queue.put(None)
        self._workers_status[worker_id] = False

    def _shutdown_workers(self, wait: bool = True) -> None:
        # Once, from whichever thread gets here first: __del__ can run in any thread that
        # happens to trigger garbage collection.
        if _python_exiting or os.getpid() != self._owner_pid:
            return
        if not self._shutdown_lock.acquire(blocking=False):
            return
        self._shutdown = True
        try:
            self._backend.shutdown(self._workers, wait=wait)
        finally:
            if self._ring is not None:
                self._learned.ring_slot_bytes = self._ring.slot_bytes
                self._ring.close()

    def close(self) -> None:
        self._shutdown_workers()

    def __del__(self) -> None:
        if hasattr(self, "_shutdown_lock"):
            self._shutdown_workers(wait=False)
