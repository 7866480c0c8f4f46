"""Everything that crosses between the main process and a worker, as frozen messages, and the
one flag they share (:class:`ShutdownFlag`).

The protocol, per worker (a thread worker follows it too, with the control pipe absent: it
reaches the slots through the slot pool itself, and hands its batch over as it made it; a Ray
actor too, its task queue and result queue carried by actor calls, its batches by the object
store: :mod:`fastfeed.backends.ray`)::

    main process                                  worker
    ────────────                                  ──────
    start(WorkerConfig)                 ───────>  seed, worker_init_fn, build the fetcher
    SlotAdded(.., fd) / SlotDropped     ─pipe──>  map / unmap; applied before every Task
    Task(seq, index, slot_id)           ───────>  fetch, collate into the slot, encode
                                        <───────  Answer(seq, Produced | ReplicaEnded | Failed)
    StartEpoch(epoch, dataset_state)    ───────>  (persistent workers) a new fetcher
                                        <───────  EpochStarted(epoch)
    Stop()                              ───────>  exit

Rules both sides rely on:

* A worker answers its tasks in the order it was given them, each exactly once, until it is
  stopped or the pool shuts down (then queued tasks are skipped unanswered; the main process
  takes their slots back once the worker has exited).
* After ``ReplicaEnded`` (its IterableDataset replica is exhausted) a worker answers nothing
  more in that epoch: the tasks queued behind it never run, and the main process cancels them
  (a Ray actor, which must reply to every call, replies ``Skipped`` to them).
* ``EpochStarted`` comes after the answers to every task of the previous epoch, so once every
  worker has acknowledged, nothing of the old epoch is still on its way.
* A ``Task`` names a slot the worker was told of (``SlotAdded``) before the task was sent, or
  none: the worker then writes the batch to a slot of its own, handed over in ``Encoded`` (a
  thread, to ordinary memory, counting the bytes it needed).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastfeed._torch_compat import ExceptionWrapper

__all__ = [
    "Answer",
    "Encoded",
    "EpochStarted",
    "Failed",
    "FromWorker",
    "InPlace",
    "PrivateSlot",
    "Produced",
    "ReplicaEnded",
    "Shipped",
    "ShutdownFlag",
    "Skipped",
    "SlotAdded",
    "SlotDropped",
    "StartEpoch",
    "Stop",
    "Task",
    "ToWorker",
    "WorkerConfig",
]


# -- at start ----------------------------------------------------------------------------------

class _SharedValues(Protocol):
    """A multiprocessing context (or module) that makes values in shared memory."""

    def RawValue(self, typecode: Any, *args: Any) -> Any: ...

    def get_start_method(self) -> str: ...


class ShutdownFlag:
    """Set once, when the pool shuts down: a worker then skips the tasks still queued.

    A ``c_bool`` without a lock, on purpose: a lock shared with workers can be left held by one
    that is killed, and the main process would hang on it while shutting down. Its memory is
    shared with the worker processes of ``context`` when one is given (it travels to them as
    they start), else this process's own (thread workers, a Ray actor's loop). Forked workers
    inherit an anonymous shared mapping, which takes no descriptor; multiprocessing's
    ``RawValue``, which spawned ones need, holds a ``/dev/shm`` file open (twice: the file,
    and its mapping's duplicate) for the rest of the process.
    """

    def __init__(self, context: _SharedValues | None = None) -> None:
        if context is None:
            self._value = ctypes.c_bool(False)
        elif context.get_start_method() == "fork":
            self._value = ctypes.c_bool.from_buffer(mmap.mmap(-1, 1))
        else:
            self._value = context.RawValue(ctypes.c_bool, False)

    def set(self) -> None:
        self._value.value = True

    def is_set(self) -> bool:
        return bool(self._value.value)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs, picklable for spawn and forkserver."""

    dataset: Any
    iterable: bool
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    drop_last: bool
    base_seed: int
    worker_init_fn: Callable[[int], None] | None
    worker_id: int
    num_workers: int
    dataset_state: Any = None  # resume this IterableDataset replica from a snapshot
    deterministic: bool = False
    main_pid: int = field(default_factory=os.getpid)  # made in the main process


# -- main process -> worker: the task queue ----------------------------------------------------

@dataclass(frozen=True)
class Task:
    """Load the batch of ``index``; write it into pool slot ``slot_id`` (None: a slot of the
    worker's own)."""

    seq: int
    index: Any
    slot_id: int | None


@dataclass(frozen=True)
class StartEpoch:
    """Start epoch ``epoch`` on a persistent worker, from ``dataset_state`` (a loader
    snapshot's IterableDataset replica state) if given."""

    epoch: int
    dataset_state: Any = None


@dataclass(frozen=True)
class Stop:
    """Exit once the tasks queued before this are done."""


# -- main process -> worker: the control pipe (process workers with a slot pool) ------------------

@dataclass(frozen=True)
class SlotAdded:
    """A new pool slot, and its file descriptor (a number of the sending process's; the pipe
    carries the descriptor itself, and the receiver gets its own number for it)."""

    slot_id: int
    nbytes: int
    fd: int


@dataclass(frozen=True)
class SlotDropped:
    """Unmap this slot: the slot pool dropped it (it was smaller than batches now need)."""

    slot_id: int


# -- worker -> main process: the result queue --------------------------------------------------

class PrivateSlot(Protocol):
    """A picklable handle on a slot a worker made for a task sent without one."""

    def detach(self) -> int:
        """The slot's file descriptor, owned by the caller from now on (once)."""
        ...


@dataclass(frozen=True)
class Encoded:
    """A batch as it crosses from a worker process: its slot, the pickled structure, the bytes
    it needed, for a task sent without a slot a handle on the slot of the worker's own that
    holds it (redeemed once with ``.detach()``), and where the tensors the collate step did not
    write into the slot were placed (see :mod:`fastfeed.codec`)."""

    slot_id: int | None
    payload: bytes
    required: int
    private_slot: PrivateSlot | None = None
    placed: bytes = b""


@dataclass(frozen=True)
class Shipped:
    """A batch as it crosses Ray's object store from an actor (:mod:`fastfeed.backends.ray.wire`).

    Attributes:
        payload: the pickled structure.
        buffers: the memory of its storages and arrays, out of band (``PickleBuffer`` on the
            actor, views of the object store once Ray has moved them).
        required: at least the bytes the batch takes in a pool slot: its buffers, each
            aligned as the codec aligns what it places (the main process may set it to what
            the batch takes once a batch tail has finished it there).
        private_slot: always None: no slot of an actor's own reaches this machine (the field
            is :class:`Encoded`'s, so that the pool reads both alike).
    """

    payload: bytes
    buffers: tuple[Any, ...]
    required: int
    private_slot: None = None


@dataclass(frozen=True)
class InPlace:
    """A batch as a worker thread made it, its tensors from ``empty`` views of the task's slot
    (:meth:`fastfeed.slots.SlotPool.writer`): nothing crosses a process, so nothing is encoded.

    Attributes:
        batch: the collate function's output, as it is.
        required: the bytes its ``empty`` tensors take in a slot, fitted or not.
        private_slot: always None: a thread makes no slot of its own (the field is
            :class:`Encoded`'s, so that the pool reads both alike).
    """

    batch: Any
    required: int
    private_slot: None = None


@dataclass(frozen=True)
class Produced:
    """A batch: ``Encoded`` from a process, ``Shipped`` from a Ray actor, ``InPlace`` from a
    thread with a slot, the batch itself from a thread without one or the main process; with
    the worker's timings, the samples it skipped, and its IterableDataset ``state_dict()``
    after the fetch."""

    batch: Any
    fetch_s: float
    collate_s: float
    dataset_state: Any = None
    skipped: int = 0


@dataclass(frozen=True)
class ReplicaEnded:
    """The worker's IterableDataset replica is exhausted."""


@dataclass(frozen=True)
class Failed:
    """The task (or the worker's start) raised; ``error`` carries the type, message and the
    worker's traceback."""

    error: ExceptionWrapper


@dataclass(frozen=True)
class Answer:
    """The outcome of task ``seq``."""

    seq: int
    outcome: Produced | ReplicaEnded | Failed


@dataclass(frozen=True)
class Skipped:
    """A Ray actor's reply to task ``seq``, queued behind the end of its IterableDataset
    replica: not run (the main process has cancelled it; a worker process sends nothing)."""

    seq: int


@dataclass(frozen=True)
class EpochStarted:
    """A persistent worker's acknowledgement of :class:`StartEpoch`."""

    epoch: int


# What a worker's task queue carries, and what it answers with.
ToWorker = Task | StartEpoch | Stop
FromWorker = Answer | EpochStarted
