"""The pool's per-worker state, in one table whose transitions assert what they expect.

A worker's life within the pool (tasks are index batches; "answered" means its result, an
error or its replica's end, has reached the main process)::

    ACTIVE ──replica ended──> EXHAUSTED ──next epoch (persistent)──> ACTIVE
       │                          └──not persistent──> STOPPED
       └──tuner retires it──> RETIRING ──its last task answered──> STOPPED

* Only ACTIVE workers are given tasks. What a worker owes (tasks sent and not answered) is
  the task book's count, the one count of outstanding work.
* When a replica ends, the tasks already queued behind it never run: the pool cancels them
  (their slots go back once) before the worker is marked EXHAUSTED, which needs none left.
* A worker may exit only when STOPPED, and is stopped only when it owes nothing: a batch sent
  outside the slot pool is fetched from the process that made it. Any other exit is a crash.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

from fastfeed.backends import WorkerHandle
from fastfeed.iterators.tasks import TaskBook

__all__ = ["WorkerState", "WorkerTable"]


class WorkerState(enum.Enum):
    ACTIVE = "active"
    EXHAUSTED = "exhausted"
    RETIRING = "retiring"
    STOPPED = "stopped"


@dataclass
class _Worker:
    handle: WorkerHandle
    state: WorkerState = WorkerState.ACTIVE
    retired: bool = False  # by the tuner: its id is never given tasks again
    exhausted_at: int | None = None  # the task index at which its replica ended


class WorkerTable:
    """Workers by id (ids are never reused), with their state; ``book`` says what each owes."""

    def __init__(self, book: TaskBook) -> None:
        self._workers: list[_Worker] = []
        self._book = book
        self.next_worker = 0  # where the round robin of dispatch goes on

    def pick(self, max_tasks: int | None) -> int | None:
        """The next ACTIVE worker in round-robin order, if any; with ``max_tasks``, only one
        that owes fewer than its share of them (torch's rule for ``in_order=False``)."""
        count = len(self._workers)
        active = self.active_count()
        for _ in range(count):
            worker_id = self.next_worker % count
            self.next_worker = worker_id + 1
            if self._workers[worker_id].state is not WorkerState.ACTIVE:
                continue
            if max_tasks is None or self._book.outstanding(worker_id) < max_tasks // active:
                return worker_id
        return None

    def add(self, handle: WorkerHandle) -> None:
        assert handle.worker_id == len(self._workers)
        self._workers.append(_Worker(handle))

    def __getitem__(self, worker_id: int) -> _Worker:
        return self._workers[worker_id]

    def __iter__(self) -> Iterator[_Worker]:
        return iter(self._workers)

    def __len__(self) -> int:
        return len(self._workers)

    @property
    def serving(self) -> int:
        """Workers not retired by the tuner: the pool's size as far as dispatch goes."""
        return sum(not w.retired for w in self._workers)

    def active_count(self) -> int:
        return sum(w.state is WorkerState.ACTIVE for w in self._workers)

    def newest_serving(self) -> int:
        return max(i for i, w in enumerate(self._workers) if not w.retired)

    def active_tasks(self) -> list[int]:
        """The kernel tasks of the workers that take tasks (for the tuner's sleep meter): a
        retiring worker is winding down, and an exited one has nothing left to read."""
        return [task for w in self._workers
                if w.state is WorkerState.ACTIVE and (task := w.handle.task_id) is not None]

    def mapping_slots(self) -> list[_Worker]:
        """Workers that must hear of new and retired pool slots."""
        return [w for w in self._workers if w.state is not WorkerState.STOPPED]

    def resumable(self) -> list[int]:
        """Workers that start the next epoch (persistent workers)."""
        return [i for i, w in enumerate(self._workers)
                if w.state in (WorkerState.ACTIVE, WorkerState.EXHAUSTED)]

    def retiring_with_tasks(self) -> bool:
        """Whether a retiring worker still owes answers."""
        return any(w.state is WorkerState.RETIRING and self._book.outstanding(i)
                   for i, w in enumerate(self._workers))

    def may_stop(self, worker_id: int) -> bool:
        """Whether a retiring worker has answered its last task."""
        worker = self._workers[worker_id]
        return worker.state is WorkerState.RETIRING and not self._book.outstanding(worker_id)

    # -- transitions -------------------------------------------------------------------------
    def exhaust(self, worker_id: int, at: int) -> None:
        worker = self._workers[worker_id]
        assert (worker.state is WorkerState.ACTIVE
                and not self._book.outstanding(worker_id)), worker
        worker.state = WorkerState.EXHAUSTED
        worker.exhausted_at = at

    def retire(self, worker_id: int) -> bool:
        """Take the worker out of dispatch; True when it owes nothing and may stop now."""
        worker = self._workers[worker_id]
        assert worker.state is WorkerState.ACTIVE and not worker.retired, worker
        worker.retired = True
        worker.state = WorkerState.RETIRING
        return not self._book.outstanding(worker_id)

    def resume(self, worker_id: int) -> None:
        worker = self._workers[worker_id]
        assert worker.state in (WorkerState.ACTIVE, WorkerState.EXHAUSTED), worker
        worker.state = WorkerState.ACTIVE
        worker.exhausted_at = None

    def stop(self, worker_id: int) -> None:
        worker = self._workers[worker_id]
        assert (worker.state is not WorkerState.STOPPED
                and not self._book.outstanding(worker_id)), worker
        worker.state = WorkerState.STOPPED
