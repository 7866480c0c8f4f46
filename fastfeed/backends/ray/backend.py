"""Workers as Ray actors on a cluster (``worker_mode="ray"``): a third backend behind the same
task book, dispatch and ordering as processes and threads.

A task's way::

    pool ── Task(seq, index, slot_id) ──> RemoteWorker.put ──actor call──> RayWorker.run
                                                        (the worker loop: fetch, collate, ship)
    pool <── Answer(seq, Produced(Encoded)) ── get(): the codec copies the batch from the
                                               object store into the task's slot, once (or
                                               the landing tail writes its finished form
                                               there); the object reference is dropped

An answer waits in Ray's object store behind its worker's oldest call, not on a queue:
:meth:`RayBackend.next_answer` waits only on each worker's oldest call, so a worker answers
in the order it was given its tasks, as the protocol says. No remote process maps the ring:
this process writes every slot, in :meth:`RayBackend.next_answer`, while the task holds the
slot's ticket.

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

import collections
import contextlib
import functools
import queue
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from fastfeed.backends.base import FromWorker, ToWorker, WorkerExited, WorkerKind
from fastfeed.backends.ray.actor import RayWorker
from fastfeed.backends.ray.options import actor_options, connected_ray
from fastfeed.backends.ray.wire import unship
from fastfeed.codec import decode, encode, slot_bytes_needed
from fastfeed.collate import Empty, torch_empty
from fastfeed.protocol import (
    Answer,
    Encoded,
    EpochStarted,
    Produced,
    Shipped,
    SlotAdded,
    StartEpoch,
    Stop,
    Task,
    WorkerConfig,
)
from fastfeed.ring import Arena, Lease, SlotRing

__all__ = ["RayBackend", "RemoteWorker"]

# Actors of one worker lost in a row, with no answer in between, before the loss is an error:
# a dataset that kills its process would otherwise be restarted forever.
MAX_LOSSES = 3


@functools.cache
def _thread_counts_are_per_thread() -> bool:
    """Whether ``torch.set_num_threads`` sets the calling thread's count alone: with OpenMP,
    ATen's parallel backend in torch's Linux builds (torch's pin-memory thread relies on it)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


@contextlib.contextmanager
def _on_one_core() -> Iterator[None]:
    """torch's ops in this thread run on one core meanwhile. Landing a batch is memory-bound
    work beside workers that keep the cores busy: split across the cores, each part waits for
    a core to come free, and the whole costs several times the CPU (on two busy cores, a float
    tail took 30 ms of CPU on two threads, 6.5 ms on one). Other threads keep their count; one
    whose first parallel op falls inside a landing starts with one thread, as torch gives a new
    thread the count last set (its own pin-memory thread leaves every later thread on one)."""
    if not _thread_counts_are_per_thread():
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(eq=False)
class _Call:
    message: Task | StartEpoch
    reply: Any  # the reference to the actor's reply in the object store
    internal: bool = False  # a new actor's StartEpoch: its reply is not the pool's


class RemoteWorker:
    """One worker on the cluster: its actor, and its calls not answered yet, oldest first.

    A message sent to it becomes an actor call. It has no process here: no pid for the
    tuner's /proc readings, and no exit reason, since a lost actor is restarted, not reported.
    """

    pid = None
    task_id = None

    def __init__(self, backend: RayBackend, config: WorkerConfig) -> None:
        self.worker_id = config.worker_id
        self.config = config
        self.calls: collections.deque[_Call] = collections.deque()
        self.epoch = 0  # of its last acknowledged StartEpoch: where a new actor starts
        self.losses = 0  # actors lost in a row
        self._backend = backend
        self._actor = backend.spawn(config, generation=0)
        self._generation = 0

    def send(self, message: ToWorker) -> None:
        if isinstance(message, Stop):  # it owes nothing (the protocol's rule)
            self.end()
        else:
            self.calls.append(_Call(message, self._actor.run.remote(message)))

    def announce_slots(self, created: Sequence[SlotAdded], retired: Sequence[int]) -> None:
        pass  # no remote process maps the ring: this one lands every batch in its slot

    def exit_reason(self) -> str | None:
        return None

    def restart(self) -> None:
        """A new actor in place of a lost one: at the same epoch, with the calls the lost one
        had not answered submitted again, in order."""
        self._backend.kill(self._actor)
        self.losses += 1
        self._generation += 1
        self._actor = self._backend.spawn(self.config, self._generation)
        unanswered = [call.message for call in self.calls if not call.internal]
        self.calls.clear()
        if self.epoch:
            start = StartEpoch(self.epoch)
            self.calls.append(_Call(start, self._actor.run.remote(start), internal=True))
        for message in unanswered:
            self.send(message)

    def end(self) -> None:
        self._backend.kill(self._actor)
        self.calls.clear()  # the replies die with their references


class _PrivateSlot:
    """A slot of this process's own, for a task sent without one: the ring adopts its
    descriptor (``detach()``), as it adopts a worker process's slot, or it closes with its
    arena."""

    def __init__(self, nbytes: int) -> None:
        self._memfd = Arena.private(nbytes)
        # The batch is written through a plain arena over the same memory: encode() hands a
        # private arena's descriptor to another process, and this one stays here.
        self.arena = Arena(None, self._memfd.buffer)

    def detach(self) -> int:
        fd = self._memfd.detach_private_slot()
        assert fd is not None, "a private slot is adopted once"
        return fd


class RayBackend:
    """Ray actors on the cluster this process is connected to.

    Args:
        ray_options: where the actors go and what each takes (see
            :func:`fastfeed.backends.ray.options.actor_options`).
        landing_tail: ``landing_tail(batch, empty)`` finishes each batch as it lands, writing
            its output with the slot's allocator: the workers then ship a dataset's short
            items (uint8 images: a quarter of float32's bytes through the object store), and
            the float batch is written into the slot where a copy would have been
            (:mod:`fastfeed.tail`).

    Raises:
        ImportError: Ray is not installed.
        RuntimeError: no cluster is connected (``ray.init`` was not called).
    """

    kind: WorkerKind = "ray"

    def __init__(self, ring: SlotRing | None, ray_options: dict[str, Any] | None = None,
                 landing_tail: Callable[[Any, Empty], Any] | None = None) -> None:
        self._ray = connected_ray()
        self._exceptions = self._ray.exceptions
        self._actor_class = self._ray.remote(RayWorker)
        self._options = {**actor_options(ray_options), "max_restarts": 0,
                         "max_task_retries": 0, "max_concurrency": 1}
        self._token = uuid.uuid4().hex[:8]  # names this backend's actors in `ray list actors`
        self._workers: dict[int, RemoteWorker] = {}
        self._ring = ring
        self._dataset: tuple[Any, Any] | None = None  # (the dataset, its object reference)
        self._landing_tail = landing_tail

    # -- starting and ending actors ----------------------------------------------------------
    def start(self, config: WorkerConfig) -> RemoteWorker:
        worker = RemoteWorker(self, config)
        self._workers[config.worker_id] = worker
        return worker

    def spawn(self, config: WorkerConfig, generation: int) -> Any:
        """An actor for ``config``'s worker; the dataset is put in the object store once, and
        each node fetches it once."""
        if self._dataset is None or self._dataset[0] is not config.dataset:
            self._dataset = (config.dataset, self._ray.put(config.dataset))
        name = f"fastfeed-{self._token}-worker{config.worker_id}-{generation}"
        return self._actor_class.options(name=name, **self._options).remote(
            replace(config, dataset=None), self._dataset[1])

    def kill(self, actor: Any) -> None:
        if self._ray.is_initialized():  # after ray.shutdown() its actors are gone already
            self._ray.kill(actor, no_restart=True)

    def shutdown(self, wait: bool = True, then: Callable[[], None] | None = None) -> None:
        """End every actor, then hand the tickets back (``then``) at once: only this process
        writes the slots, and only while it receives an answer."""
        for worker in self._workers.values():
            worker.end()
        self._workers.clear()
        self._dataset = None
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

    def _take(self, worker: RemoteWorker) -> Answer | EpochStarted | None:
        """The reply of ``worker``'s oldest call, landed; None for one that is not the pool's,
        and after a lost actor is replaced."""
        call = worker.calls[0]
        try:
            reply = self._ray.get(call.reply)
        except self._exceptions.RayError as error:
            self._lost(worker, error)
            return None
        worker.calls.popleft()
        if reply is None:  # a task queued behind its replica's end: the pool cancelled it
            return None
        if isinstance(reply, EpochStarted):
            worker.epoch = reply.epoch
            return None if call.internal else reply
        worker.losses = 0
        if isinstance(reply.outcome, Produced):
            assert isinstance(call.message, Task)
            with _on_one_core():
                batch = self._into_slot(reply.outcome.batch, call.message.slot_id)
            reply = Answer(reply.seq, replace(reply.outcome, batch=batch))
        return reply

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

    def _into_slot(self, shipped: Shipped, slot_id: int | None) -> Encoded | Any:
        """The batch, copied once from the object store, or finished from there by the
        landing tail: into the task's ring slot, or into a slot of this process's own for a
        task sent without one (the ring adopts it); without a ring, into memory of its own."""
        batch = unship(shipped)
        land = self._landing_tail
        if self._ring is None:  # the shipped batch copied out, then finished
            buffer = torch.empty(shipped.nbytes, dtype=torch.uint8)
            batch = decode(encode(batch, Arena(None, buffer)), Lease(buffer.numpy()))
            return batch if land is None else land(batch, torch_empty)
        if slot_id is not None:
            memory: np.ndarray = self._ring.assigned_memory(slot_id)
            arena = Arena(slot_id, torch.from_numpy(memory))
            return encode(batch if land is None else land(batch, arena.empty), arena)
        nbytes = shipped.nbytes
        if land is not None:  # the finished batch's size is known once it is made
            batch = land(batch, torch_empty)
            nbytes = slot_bytes_needed(batch)
        slot = _PrivateSlot(nbytes)
        return replace(encode(batch, slot.arena), private_slot=slot)
