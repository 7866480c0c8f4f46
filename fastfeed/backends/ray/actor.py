"""One DataLoader worker as a Ray actor: the worker side of ``worker_mode="ray"``.

The actor hosts the very loop a worker process runs (:func:`fastfeed.worker.worker_loop`), on
a thread of its own fed through in-process queues, so seeding, ``get_worker_info()``,
``worker_init_fn``, errors, IterableDataset exhaustion and persistent epochs cannot drift
from a local worker's. Each actor call hands the loop one message and returns its reply, with
the batch made ready for Ray's object store (:mod:`fastfeed.backends.ray.wire`), collated into
memory the actor reuses for every batch, as a worker process collates into a pool slot. Ray
runs an actor's calls one at a time, in the order they were submitted: the protocol's order.
"""

from __future__ import annotations

import math
import os
import queue
import threading
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from fastfeed._torch_compat import ExceptionWrapper
from fastfeed.backends.ray.wire import ship
from fastfeed.collate import as_collate_into
from fastfeed.protocol import (
    Answer,
    EpochStarted,
    Failed,
    Produced,
    ReplicaEnded,
    ShutdownFlag,
    Skipped,
    StartEpoch,
    Task,
    WorkerConfig,
)
from fastfeed.slots.memory import ALIGN, round_up
from fastfeed.worker import own_process, worker_loop

__all__ = ["RayWorker"]

# How often a call waiting on the loop checks that the loop is still there.
_LOOP_CHECK_S = 1.0


class RayWorker:
    """A worker on the cluster (made a Ray actor by the backend; this module imports Ray only
    once an actor runs it).

    Args:
        shared: what every worker of the iterator shares (the script's objects pickled
            together: see :meth:`fastfeed.backends.ray.backend.RayBackend.spawn`), which the
            backend puts in the object store once; Ray resolves it before the actor starts.
        worker_id, num_workers, dataset_state: this worker's seat.
    """

    def __init__(self, shared: WorkerConfig, worker_id: int, num_workers: int,
                 dataset_state: Any) -> None:
        from ray import cloudpickle  # in an actor, Ray is there

        self._pickler = cloudpickle.CloudPickler
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._replica_ended = False
        self._loop = threading.Thread(
            target=worker_loop,
            # Never shutting down, and its main process is the actor's own: the backend ends
            # the actor, and Ray ends it with its owner (the driver's pid, which the config
            # carries, names no process of this node on another machine).
            args=(replace(shared, worker_id=worker_id, num_workers=num_workers,
                          dataset_state=dataset_state, main_pid=os.getpid(),
                          collate_fn=_ReusedMemory(shared.collate_fn)),
                  self._tasks, self._replies, ShutdownFlag(), None, own_process, "process"),
            name=f"fastfeed-worker-{worker_id}", daemon=True)
        self._loop.start()

    def run(self, message: Task | StartEpoch) -> Answer | EpochStarted | Skipped:
        """The loop's reply to ``message``; :class:`Skipped` for a task queued behind the end
        of the worker's IterableDataset replica, which the loop skips (the main process has
        cancelled it)."""
        if isinstance(message, Task) and self._replica_ended:
            return Skipped(message.seq)
        self._tasks.put(message)
        reply = self._reply()
        if isinstance(reply, EpochStarted):
            self._replica_ended = False
        elif isinstance(reply.outcome, ReplicaEnded):
            self._replica_ended = True
        elif isinstance(reply.outcome, Produced):
            reply = Answer(reply.seq, self._shipped(reply.outcome))
        return reply

    def _reply(self) -> Any:
        while True:
            try:
                return self._replies.get(timeout=_LOOP_CHECK_S)
            except queue.Empty:
                if not self._loop.is_alive():
                    raise RuntimeError("the worker loop ended") from None

    def _shipped(self, produced: Produced) -> Produced | Failed:
        try:
            return replace(produced, batch=ship(produced.batch, self._pickler))
        except Exception:
            # As a batch a worker process cannot encode: raised in the batch's turn.
            return Failed(ExceptionWrapper(where="in a DataLoader worker on Ray, pickling "
                                                 "its batch"))


class _ReusedMemory:
    """``collate_fn``, stacking its tensors into memory that every batch reuses (as a worker
    process collates into a pool slot): its pages are faulted in once, not for every batch.

    Reuse is safe because Ray copies a call's reply into its object store before the actor
    runs its next call, and the loop collates a batch only when a call asks for it. Each
    tensor gets a storage of its own size over that memory, so that only its bytes travel. A
    batch larger than the memory takes ordinary memory for what does not fit, and the next
    batch memory of its size. A ``collate_fn`` that allocates its own output is called as it is.
    """

    def __init__(self, collate_fn: Any) -> None:
        self._collate_into = as_collate_into(collate_fn)
        self._memory = np.empty(0, dtype=np.uint8)
        self._used = 0

    def __call__(self, samples: list) -> Any:
        self._used = 0
        batch = self._collate_into(samples, self._empty)
        if self._used > self._memory.nbytes:
            self._memory = np.empty(self._used, dtype=np.uint8)
        return batch

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        start = round_up(self._used, ALIGN)
        self._used = start + nbytes
        if self._used > self._memory.nbytes:
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(self._memory[start : self._used]).view(dtype).view(shape)
