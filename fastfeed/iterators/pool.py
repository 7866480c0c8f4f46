"""A pool of worker processes that collate into the ring.

Dispatch and reordering follow torch's ``_MultiProcessingDataLoaderIter``: indices go to
workers round-robin, at most ``prefetch_factor`` tasks per worker are outstanding, results are
returned in sampler order (or as they arrive with ``in_order=False``), and IterableDataset
replicas are interleaved. What differs is what crosses the process boundary: each task carries
a ring slot, and the result is a small message that ``codec.decode`` turns back into tensors
that are views of that slot.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import signal
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch._utils import ExceptionWrapper

from fastfeed.codec import Encoded, decode
from fastfeed.iterators.base import BaseIterator
from fastfeed.resume import LoaderState
from fastfeed.ring import SlotRing, WorkerSlots, ring_supported
from fastfeed.worker import Resume, WorkerConfig, WorkerDone, worker_loop

if TYPE_CHECKING:
    from fastfeed.loader import FastLoader

__all__ = ["WorkerPoolIterator"]

# How often a waiting main process checks that its workers are alive.
_LIVENESS_INTERVAL = 0.2
# How long shutdown waits for workers to exit on their own before terminating them.
_SHUTDOWN_GRACE = 2.0
# Beyond the slots of in-flight tasks: the batch being decoded and the one the user still holds.
_SPARE_SLOTS = 2

_python_exiting = False


def _mark_exiting() -> None:
    global _python_exiting
    _python_exiting = True


atexit.register(_mark_exiting)


@dataclass
class _Task:
    worker_id: int
    slot_id: int | None
    result: Any = field(default=None)
    done: bool = False
    dataset_state: Any = None


def _describe_exit(exitcode: int) -> str:
    if exitcode < 0:
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
    return f"exit code {exitcode}."


class WorkerPoolIterator(BaseIterator):
    """Iterates a FastLoader with ``num_workers > 0`` worker processes."""

    def __init__(self, loader: FastLoader) -> None:
        super().__init__(loader)
        assert loader.prefetch_factor is not None and loader.prefetch_factor > 0
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = loader.in_order
        self._max_tasks = self._prefetch_factor * self._num_workers
        self._loader_ref = weakref.ref(loader)
        self._shutdown = False
        self._epoch = 0

        slots = loader.ring_slots
        if slots is None:
            slots = self._max_tasks + _SPARE_SLOTS + loader._batches_held_by_prefetch
        self._ring = (
            SlotRing(slots, pin=loader._pins_ring, slot_bytes=loader._ring_slot_bytes)
            if slots > 0 and ring_supported()
            else None
        )

        ctx = loader.multiprocessing_context or torch.multiprocessing
        self._result_queue = ctx.Queue()
        self._done_event = ctx.Event()
        self._index_queues: list[Any] = []
        self._controls: list[Any] = []
        self._workers: list[Any] = []
        try:
            for worker_id in range(self._num_workers):
                self._start_worker(ctx, loader, worker_id)
        except BaseException:
            self._shutdown_workers()
            raise
        self._reset(loader, first_iter=True)

    def _start_worker(self, ctx: Any, loader: FastLoader, worker_id: int) -> None:
        config = WorkerConfig(
            dataset=self._dataset,
            iterable=self._iterable,
            auto_collation=self._auto_collation,
            collate_fn=self._collate_fn,
            drop_last=self._drop_last,
            base_seed=self._base_seed,
            worker_init_fn=loader.worker_init_fn,
            worker_id=worker_id,
            num_workers=self._num_workers,
            dataset_state=self._resume_dataset_state(self._resume, worker_id),
        )
        index_queue = ctx.Queue()
        index_queue.cancel_join_thread()
        control, worker_control = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=worker_loop,
            args=(config, index_queue, self._result_queue, self._done_event, worker_control),
            daemon=True,
        )
        self._index_queues.append(index_queue)
        self._controls.append(control)
        self._workers.append(process)
        process.start()
        worker_control.close()

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

    def _reset(self, loader: FastLoader, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        resume = self._epoch_resume
        if not first_iter:
            self._epoch += 1
            self._workers_status = [True] * self._num_workers  # every worker must acknowledge
            for worker_id, index_queue in enumerate(self._index_queues):
                index_queue.put(Resume(self._epoch, self._resume_dataset_state(resume, worker_id)))
            # Results of the abandoned epoch arrive before each worker's acknowledgement.
            acknowledged = 0
            while acknowledged < self._num_workers:
                idx, result = self._get_result()
                if isinstance(idx, Resume):
                    acknowledged += idx.epoch == self._epoch
                elif idx in self._tasks:
                    self._receive(self._tasks[idx], result)
            for task in self._tasks.values():
                if not task.done:
                    self._release(task.slot_id)
        self._send_idx = 0
        self._rcvd_idx = 0
        self._tasks: dict[int, _Task] = {}
        self._tasks_outstanding = 0
        self._workers_status = [True] * self._num_workers
        self._workers_num_tasks = [0] * self._num_workers
        self._worker_cycle = itertools.cycle(range(self._num_workers))
        self._done_at: dict[int, int] = {}  # worker id -> task index its replica ended at
        if resume is not None and resume.dataset_states is not None:
            # Continue the round robin where the snapshot left it.
            for _ in range(resume.next_worker):
                next(self._worker_cycle)
            done = resume.workers_done or [False] * self._num_workers
            self._workers_status = [not d for d in done]
        for _ in range(self._max_tasks):
            self._try_put_index()

    # -- dispatch ----------------------------------------------------------------------------
    def _try_put_index(self) -> None:
        assert self._tasks_outstanding < self._max_tasks
        try:
            index = self._next_index()
        except StopIteration:
            return
        for _ in range(self._num_workers):  # the next active worker, if any
            worker_id = next(self._worker_cycle)
            if not self._workers_status[worker_id]:
                continue
            if self._in_order:
                break
            active = sum(self._workers_status)
            if self._workers_num_tasks[worker_id] < self._max_tasks // active:
                break
        else:
            return
        slot_id = self._acquire_slot()
        self._index_queues[worker_id].put((self._send_idx, index, slot_id))
        self._tasks[self._send_idx] = _Task(worker_id, slot_id)
        self._workers_num_tasks[worker_id] += 1
        self._tasks_outstanding += 1
        self._send_idx += 1

    def _acquire_slot(self) -> int | None:
        if self._ring is None:
            return None
        slot, created, retired = self._ring.acquire()
        for control, process in zip(self._controls, self._workers, strict=True):
            if process.exitcode is not None:
                continue
            try:
                for slot_id in retired:
                    WorkerSlots.retire(control, slot_id)
                for new in created:
                    WorkerSlots.announce(control, process.pid, new.slot_id, new.nbytes, new.fd)
            except OSError:
                pass  # the worker died; _get_result reports it
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
                return self._result_queue.get(timeout=wait)
            except queue.Empty:
                pass
            self._check_workers()
            if deadline is not None and time.monotonic() >= deadline:
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")

    def _check_workers(self, wait: float = 0.0) -> None:
        """Raise if an active worker has died, waiting up to ``wait`` s for one that is dying."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and all(p.exitcode is None for p in self._workers):
            time.sleep(0.02)
        for worker_id, process in enumerate(self._workers):
            if self._workers_status[worker_id] and process.exitcode is not None:
                message = (
                    f"DataLoader worker {worker_id} (pid {process.pid}) exited unexpectedly: "
                    + _describe_exit(process.exitcode)
                )
                self._shutdown_workers()
                raise RuntimeError(message)

    def _next_data(self) -> Any:
        while True:
            while self._rcvd_idx < self._send_idx:
                task = self._tasks.get(self._rcvd_idx)
                if task is not None:
                    if task.done or self._workers_status[task.worker_id]:
                        break
                    # its worker's IterableDataset replica ended; the task never ran
                    self._release(self._tasks.pop(self._rcvd_idx).slot_id)
                self._rcvd_idx += 1
            else:
                if not self._persistent_workers:
                    self._shutdown_workers()
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
                    self._retire_worker(result.worker_id)
                self._try_put_index()
                continue
            self._receive(arrived, result)
            if idx == self._rcvd_idx or not self._in_order:
                del self._tasks[idx]
                if idx == self._rcvd_idx:
                    self._rcvd_idx += 1
                return self._process(arrived)

    def _receive(self, task: _Task, result: Any) -> None:
        # Decode at once: shared memory sent outside the ring is fetched from the worker, which
        # may exit (an exhausted IterableDataset replica) before this batch's turn comes.
        task.done = True
        if isinstance(result, Encoded):
            task.dataset_state = result.dataset_state
            if self._ring is not None:
                self._ring.note_required(result.required)
            try:
                task.result = decode(result, self._ring)  # the batch now holds the slot's lease
            except (OSError, EOFError):
                # Shared memory outside the ring is fetched from its worker: if that worker
                # died, say so rather than surface a socket error.
                self._release(task.slot_id)
                self._check_workers(wait=_SHUTDOWN_GRACE)
                raise
        else:
            self._release(task.slot_id)
            task.result = result

    def _process(self, task: _Task) -> Any:
        self._workers_num_tasks[task.worker_id] -= 1
        self._try_put_index()
        if isinstance(task.result, ExceptionWrapper):
            task.result.reraise()
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
                             for w in range(self._num_workers)],
        }

    # -- shutdown ----------------------------------------------------------------------------
    def _retire_worker(self, worker_id: int) -> None:
        self._index_queues[worker_id].put(None)
        self._workers_status[worker_id] = False

    def _shutdown_workers(self) -> None:
        if self._shutdown or _python_exiting:
            return
        self._shutdown = True
        try:
            self._done_event.set()
            for index_queue, process in zip(self._index_queues, self._workers, strict=True):
                if process.exitcode is None:
                    index_queue.put(None)
            deadline = time.monotonic() + _SHUTDOWN_GRACE
            for process in self._workers:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for process in self._workers:
                if process.exitcode is None:
                    process.terminate()
                    process.join(timeout=_SHUTDOWN_GRACE)
            for index_queue in self._index_queues:
                index_queue.cancel_join_thread()
                index_queue.close()
            self._result_queue.cancel_join_thread()
            self._result_queue.close()
            for control in self._controls:
                control.close()
            if self._ring is not None:
                loader = self._loader_ref()
                if loader is not None:
                    loader._ring_slot_bytes = self._ring.slot_bytes
                self._ring.close()

    def __del__(self) -> None:
        self._shutdown_workers()
