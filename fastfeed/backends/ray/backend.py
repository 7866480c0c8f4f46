"""Workers as Ray actors on a cluster (``worker_mode="ray"``): a third backend behind the same
task book, dispatch and ordering as processes and threads.

A task's way::

    pool ── Task(seq, index, slot_id) ──> RemoteWorker.send ──actor call──> RayWorker.run
                                                        (the worker loop: fetch, collate, ship)
    pool <── Answer(seq, Produced(Shipped)) ── next_answer(); the object reference is dropped
    pool: the task's lease ──> rebuild(): the batch lands in its slot, copied once
                                          (:mod:`~fastfeed.backends.ray.landing`)

An answer waits in Ray's object store behind its worker's oldest call, not on a queue:
:meth:`RayBackend.next_answer` waits only on each worker's oldest call, so a worker answers
in the order it was given its tasks, as the protocol says.

A lost actor (its node died, its process was killed) is not reported as a dead worker. The
backend starts a new actor from the same :class:`~fastfeed.protocol.WorkerConfig` (worker id,
seeds, ``worker_init_fn``) wherever Ray places it, brings it to the epoch its predecessor was
in, and submits the calls that were not answered again, in order: the pool sees every task
answered once. With ``deterministic=True`` the batches are those of a run without the loss;
without it, the new actor's random stream starts again from the worker's seed. An
IterableDataset replica cannot be replayed elsewhere: losing its worker raises, as a dead
local worker does.
"""

from __future__ import annotations

import queue
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

from fastfeed.backends.interface import BackendArgs, BackendTraits, WorkerExited
from fastfeed.backends.ray.actor import RayWorker
from fastfeed.backends.ray.cluster import actor_options, cluster_workers, connected_ray
from fastfeed.backends.ray.landing import Landing
from fastfeed.backends.ray.remote import RemoteWorker
from fastfeed.protocol import Answer, EpochStarted, FromWorker, Produced, Skipped, WorkerConfig
from fastfeed.slots import Lease

__all__ = ["RayBackend"]

# Actors of one worker lost in a row, with no answer in between, before the loss is an error:
# a dataset that kills its process would otherwise be restarted forever.
MAX_LOSSES = 3


class RayBackend:
    """Ray actors on the cluster this process is connected to.

    Args:
        args: ``placement`` says where the actors go and what each takes (see
            :func:`fastfeed.backends.ray.cluster.actor_options`); ``landing_tail`` finishes
            each batch as it lands (see :class:`~fastfeed.backends.ray.landing.Landing`). This
            process writes the batches into the slot pool's slots itself.

    Raises:
        ImportError: Ray is not installed.
        RuntimeError: no cluster is connected (``ray.init`` was not called).
    """

    name: ClassVar[str] = "ray"
    traits: ClassVar[BackendTraits] = BackendTraits(uses_slot_pool=True, lands_batches=True,
                                                    uses_cluster_cores=True)

    def __init__(self, args: BackendArgs) -> None:
        self._ray = connected_ray()
        self._exceptions = self._ray.exceptions
        self._actor_class = self._ray.remote(RayWorker)
        self._options = {**actor_options(args.placement), "max_restarts": 0,
                         "max_task_retries": 0, "max_concurrency": 1}
        self._token = uuid.uuid4().hex[:8]  # names this backend's actors in `ray list actors`
        self._workers: dict[int, RemoteWorker] = {}
        # The workers' configuration but their seats, in the object store (see spawn()).
        self._shared: tuple[WorkerConfig, Any] | None = None
        self._landing = Landing(args.landing_tail)

    @classmethod
    def refusal(cls, dataset: Any, deterministic: bool) -> str | None:
        return None

    @classmethod
    def placement(cls, ray_options: dict[str, Any] | None) -> dict[str, Any] | None:
        return actor_options(ray_options)

    @classmethod
    def worker_bounds(cls, placement: dict[str, Any] | None) -> tuple[int, int]:
        return cluster_workers(placement or {})

    # -- starting and ending actors ----------------------------------------------------------
    def start(self, config: WorkerConfig) -> RemoteWorker:
        worker = RemoteWorker(self, config)
        self._workers[config.worker_id] = worker
        return worker

    def spawn(self, config: WorkerConfig, generation: int) -> Any:
        """An actor for ``config``'s worker.

        The workers of one iterator differ only in their seat (id, pool size, replica state).
        All the rest, what each runs of the training script included (the dataset,
        ``collate_fn``, ``worker_init_fn``), is put in the object store once, in one pickle,
        which each node fetches once: pickled apart, each of those would arrive with its own
        copy of the script's globals, and what ``worker_init_fn`` keeps in a global would not
        reach the dataset, as it does in a worker process. The seat travels with the call."""
        if self._shared is None:
            shared = replace(config, worker_id=0, num_workers=0, dataset_state=None)
            self._shared = (shared, self._ray.put(shared))
        shared = self._shared[0]
        assert (shared.dataset is config.dataset and shared.collate_fn is config.collate_fn
                and shared.worker_init_fn is config.worker_init_fn), "one iterator's workers"
        name = f"fastfeed-{self._token}-worker{config.worker_id}-{generation}"
        return self._actor_class.options(name=name, **self._options).remote(
            self._shared[1], config.worker_id, config.num_workers, config.dataset_state)

    def kill(self, actor: Any) -> None:
        if self._ray.is_initialized():  # after ray.shutdown() its actors are gone already
            self._ray.kill(actor, no_restart=True)

    def shutdown(self, wait: bool = True, then: Callable[[], None] | None = None) -> None:
        """End every actor, then hand the tickets back (``then``) at once: only this process
        writes the slots, and only while it receives an answer."""
        for worker in self._workers.values():
            worker.end()
        self._workers.clear()
        self._shared = None
        if then is not None:
            then()

    # -- receiving ---------------------------------------------------------------------------
    def next_answer(self, timeout: float) -> FromWorker:
        """The next reply of any worker, its batch in its slot.

        Raises:
            queue.Empty: none within ``timeout`` seconds.
            WorkerExited: a worker was lost and cannot be restarted (an IterableDataset
                replica, or one lost too often), or failed in Ray itself.
        """
        deadline = time.monotonic() + timeout
        while True:
            oldest = {w.calls[0].reply: w for w in self._workers.values() if w.calls}
            remaining = max(0.0, deadline - time.monotonic())
            if not oldest:  # nothing owed: let the crew's checks (its timeout) run
                time.sleep(remaining)
                raise queue.Empty
            ready, _ = self._ray.wait(list(oldest), num_returns=1, timeout=remaining,
                                      fetch_local=True)
            if not ready:
                raise queue.Empty
            reply = self._take(oldest[ready[0]])
            if reply is not None:
                return reply

    def _take(self, worker: RemoteWorker) -> FromWorker | None:
        """The reply of ``worker``'s oldest call, its batch landed; None when there is nothing
        for the pool (a reply that is not the pool's, a lost actor replaced)."""
        call = worker.calls[0]
        try:
            reply = self._ray.get(call.reply)
        except self._exceptions.RayError as error:
            self._lost(worker, error)
            return None
        worker.calls.popleft()
        if isinstance(reply, Skipped):  # a task queued behind its replica's end, cancelled
            return None
        if isinstance(reply, EpochStarted):
            worker.epoch = reply.epoch
            return None if call.internal else reply
        worker.losses = 0
        if isinstance(reply.outcome, Produced):  # what the pool sizes its slots by
            shipped = reply.outcome.batch
            shipped = replace(shipped, required=self._landing.required(shipped))
            reply = Answer(reply.seq, replace(reply.outcome, batch=shipped))
        return reply

    def rebuild(self, batch: Any, lease: Lease | None) -> Any:
        return self._landing.land(batch, lease)

    def _lost(self, worker: RemoteWorker, error: Exception) -> None:
        """Restart ``worker`` after Ray lost its actor or a reply of it; raise instead where a
        restart cannot help or cannot replay it."""
        worker_id = worker.config.worker_id
        exceptions = self._exceptions
        if isinstance(error, exceptions.RayActorError) and error.actor_init_failed:
            # Its dataset or configuration did not arrive (cannot be unpickled there, say).
            raise WorkerExited(f"DataLoader worker {worker_id} (a Ray actor) could not "
                               f"start: {error}") from error
        if not isinstance(error, (exceptions.RayActorError, exceptions.ObjectLostError)):
            raise WorkerExited(f"DataLoader worker {worker_id} (a Ray actor) failed: "
                               f"{error}") from error
        if worker.config.iterable:
            raise WorkerExited(
                f"DataLoader worker {worker_id} (a Ray actor) was lost: {error}\nIts "
                "IterableDataset replica cannot be replayed on another actor.") from error
        if worker.losses >= MAX_LOSSES:
            raise WorkerExited(
                f"DataLoader worker {worker_id} (a Ray actor) was lost {MAX_LOSSES + 1} times "
                f"in a row, the last time: {error}") from error
        warnings.warn(
            f"fastfeed: DataLoader worker {worker_id} (a Ray actor) was lost "
            f"({str(error).strip().splitlines()[-1]}); restarting it and running its "
            f"{len(worker.calls)} unanswered calls again", RuntimeWarning, stacklevel=2)
        worker.restart()
