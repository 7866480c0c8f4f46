"""The one protocol every worker backend follows, whatever runs the workers.

The pool iterator decides what each worker does (:mod:`fastfeed.iterators.crew`); a backend
only carries it out, through two objects:

* :class:`WorkerBackend` starts workers, hands over their answers in the order each worker
  gave them, and shuts them all down;
* :class:`WorkerHandle` is one started worker: messages go to it, the pool's slots are
  announced to it, and it says whether it is still alive (liveness).

The pool grows by starting workers and shrinks by sending :class:`~fastfeed.protocol.Stop`
to one that owes nothing. What crosses is :mod:`fastfeed.protocol`'s messages, nothing else:
a backend that must say something of its own to its workers (a Ray actor's replacement)
keeps it to itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

from fastfeed.protocol import Answer, EpochStarted, SlotAdded, StartEpoch, Stop, Task, WorkerConfig

__all__ = ["ABANDONED_GRACE", "SHUTDOWN_GRACE", "FromWorker", "QueueFedWorker", "ToWorker",
           "WorkerBackend", "WorkerExited", "WorkerHandle", "WorkerKind"]

WorkerKind = Literal["process", "thread", "ray"]
ToWorker = Task | StartEpoch | Stop
FromWorker = Answer | EpochStarted

# How long shutdown waits for workers to exit on their own before terminating them: at the
# end of an epoch (idle workers exit at once), and when an iterator was abandoned mid-epoch
# (a worker may be busy in a long __getitem__ whose result nobody wants).
SHUTDOWN_GRACE = 2.0
ABANDONED_GRACE = 0.5


class WorkerExited(RuntimeError):
    """A worker that should be running is gone (the message names it and why)."""


class WorkerHandle(Protocol):
    """One worker, as the pool reaches it."""

    @property
    def worker_id(self) -> int: ...

    @property
    def pid(self) -> int | None:
        """The process that runs the worker (this one for a thread; None for a Ray actor,
        which has none here)."""
        ...

    @property
    def task_id(self) -> int | None:
        """The kernel task that runs the worker's loop (``/proc/<id>``, which the tuner reads):
        the process's pid, or the thread's native id; None before it starts, or off this
        machine."""
        ...

    def send(self, message: ToWorker) -> None:
        """Queue ``message`` for the worker; it is handled after those sent before it."""
        ...

    def announce_slots(self, created: Sequence[SlotAdded], retired: Sequence[int]) -> None:
        """Tell the worker of the pool slots created and dropped since it was last told (a
        worker that maps no slot ignores it)."""
        ...

    def exit_reason(self) -> str | None:
        """Why the worker is gone, or None while it runs."""
        ...


class QueueFedWorker:
    """A worker that takes its messages from a queue: a process's (shared with it) or a
    thread's."""

    task_queue: Any

    def send(self, message: ToWorker) -> None:
        self.task_queue.put(message)


class WorkerBackend(Protocol):
    """Starts, hears from and stops the workers of one pool iterator."""

    kind: WorkerKind

    def start(self, config: WorkerConfig) -> WorkerHandle:
        """Start a worker; it maps the pool's slots that exist already, if it maps any."""
        ...

    def next_answer(self, timeout: float) -> FromWorker:
        """The next message of any worker, each worker's in the order it sent them.

        Raises:
            queue.Empty: none came within ``timeout`` seconds.
            WorkerExited: a worker is gone for good (a backend that can replace a lost worker
                does so instead).
        """
        ...

    def shutdown(self, wait: bool = True, then: Callable[[], None] | None = None) -> None:
        """Stop every worker this backend started, then call ``then`` once nothing of theirs
        can write a pool slot any more. With ``wait=False`` (a finaliser, in whatever thread
        the garbage collector runs) nothing blocks: joins happen on a thread of their own."""
        ...
