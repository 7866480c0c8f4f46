"""The one protocol every worker backend follows, whatever runs the workers.

The pool iterator decides what each worker does (:mod:`fastfeed.iterators.crew`); a backend
only carries it out, through two objects:

* :class:`WorkerBackend` starts workers, hands over their answers in the order each worker
  gave them, rebuilds each answer's batch, and shuts them all down;
* :class:`WorkerHandle` is one started worker: messages go to it, the pool's slots are
  announced to it, and it says whether it is still alive (liveness).

A backend class also says what it is (:class:`BackendTraits`) and which loaders it cannot run
(:meth:`WorkerBackend.refusal`): the rest of fastfeed asks those, never the backend's name
(:mod:`fastfeed.backends.registry` maps a ``worker_mode`` to its class).

The pool grows by starting workers and shrinks by sending :class:`~fastfeed.protocol.Stop`
to one that owes nothing. What crosses is :mod:`fastfeed.protocol`'s messages, nothing else:
a backend that must say something of its own to its workers (a Ray actor's replacement)
keeps it to itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, ClassVar, Protocol

from fastfeed.collate import Empty
from fastfeed.protocol import FromWorker, SlotAdded, ToWorker, WorkerConfig
from fastfeed.shared_lists import ListsCache
from fastfeed.slots import Lease, SlotPool

__all__ = ["ABANDONED_GRACE", "SHUTDOWN_GRACE", "BackendArgs", "BackendTraits", "WorkerBackend",
           "WorkerExited", "WorkerHandle"]


@dataclass(frozen=True)
class BackendArgs:
    """What the pool iterator builds its backend with.

    Attributes:
        slot_pool: the loader's (None: it has none, or the backend uses none).
        multiprocessing_context: the loader's (None: torch's default).
        placement: where the workers go, as :meth:`WorkerBackend.placement` checked it.
        landing_tail: finishes each batch as this process lands it (a backend whose traits
            say it lands batches; see :mod:`fastfeed.tail_split`).
        lists: the loader's packed lists: workers that own their process read the dataset's
            large lists from one shared copy (:mod:`fastfeed.shared_lists`); None: they do not.
    """

    slot_pool: SlotPool | None = None
    multiprocessing_context: Any = None
    placement: dict[str, Any] | None = None
    landing_tail: Callable[[Any, Empty], Any] | None = None
    lists: ListsCache | None = None


@dataclass(frozen=True)
class BackendTraits:
    """What a backend is, as the loader, the pool and the integrations need to know it.

    Attributes:
        uses_slot_pool: its workers' batches reach the consumer through the loader's pool of
            shared-memory slots (none is made for a backend without it).
        lands_batches: this process writes each batch into its slot itself, as it arrives
            (workers off this machine); a batch tail then runs here, on landing.
        in_this_process: the workers are threads of this process: they share its global
            random generators and are not seeded, ``get_worker_info()`` cannot describe them,
            and per-process state of a dataset is shared between them.
        uses_cluster_cores: the workers run on a cluster's cores, not this machine's: the
            worker count is not held against this machine's cores, and ``num_workers="auto"``
            grows into the cluster's free resources.
    """

    uses_slot_pool: bool
    lands_batches: bool = False
    in_this_process: bool = False
    uses_cluster_cores: bool = False


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

    @property
    def process(self) -> BaseProcess | None:
        """The worker's process, where it has one of its own on this machine (torch's iterator
        lists these in ``_workers``, which frameworks terminate themselves)."""
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


class WorkerBackend(Protocol):
    """Starts, hears from and stops the workers of one pool iterator.

    A backend is built from :class:`BackendArgs`.
    """

    name: ClassVar[str]  # its ``worker_mode``
    traits: ClassVar[BackendTraits]

    def __init__(self, args: BackendArgs) -> None: ...

    @classmethod
    def refusal(cls, dataset: Any, deterministic: bool) -> str | None:
        """Why this backend cannot run a loader of ``dataset``, or None if it can."""
        ...

    @classmethod
    def placement(cls, ray_options: dict[str, Any] | None) -> dict[str, Any] | None:
        """The placement of workers the user asked for, checked; None where it takes none.

        Raises:
            ValueError, TypeError: options this backend cannot take.
        """
        ...

    @classmethod
    def worker_bounds(cls, placement: dict[str, Any] | None) -> tuple[int, int]:
        """``num_workers="auto"``'s first worker count and its most."""
        ...

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

    def rebuild(self, batch: Any, lease: Lease | None) -> Any:
        """The batch of a :class:`~fastfeed.protocol.Produced` answer as the consumer gets it:
        over ``lease``'s memory (its slot) where it has one."""
        ...

    def shutdown(self, wait: bool = True, then: Callable[[], None] | None = None) -> None:
        """Stop every worker this backend started, then call ``then`` once nothing of theirs
        can write a pool slot any more. With ``wait=False`` (a finaliser, in whatever thread
        the garbage collector runs) nothing blocks: joins happen on a thread of their own."""
        ...

