"""One worker on the cluster, as the pool reaches it: its actor, the calls the actor has not
answered yet (oldest first), and a new actor in its place when Ray loses it."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastfeed.protocol import SlotAdded, StartEpoch, Stop, Task, ToWorker, WorkerConfig

__all__ = ["Actors", "Call", "RemoteWorker"]


class Actors(Protocol):
    """What starts and ends the actors of one backend."""

    def spawn(self, config: WorkerConfig, generation: int) -> Any:
        """A new actor (a Ray actor handle) for ``config``'s worker."""
        ...

    def kill(self, actor: Any) -> None: ...


@dataclass(eq=False)
class Call:
    """One actor call not answered yet."""

    message: Task | StartEpoch
    reply: Any  # the reference to the actor's reply in the object store
    internal: bool = False  # a new actor's StartEpoch: its reply is not the pool's


class RemoteWorker:
    """One worker on the cluster (a :class:`~fastfeed.backends.interface.WorkerHandle`).

    A message sent to it becomes an actor call. It has no process here: no pid for the
    tuner's /proc readings, and no exit reason, since a lost actor is restarted, not reported.
    """

    pid = None
    task_id = None
    process = None

    def __init__(self, actors: Actors, config: WorkerConfig) -> None:
        self.worker_id = config.worker_id
        self.config = config
        self.calls: collections.deque[Call] = collections.deque()
        self.epoch = 0  # of its last acknowledged StartEpoch: where a new actor starts
        self.losses = 0  # actors lost in a row
        self._actors = actors
        self._actor = actors.spawn(config, generation=0)
        self._generation = 0

    def send(self, message: ToWorker) -> None:
        if isinstance(message, Stop):  # it owes nothing (the protocol's rule)
            self.end()
        else:
            self.calls.append(Call(message, self._actor.run.remote(message)))

    def announce_slots(self, created: Sequence[SlotAdded], retired: Sequence[int]) -> None:
        pass  # no remote process maps the slot pool: this one lands every batch in its slot

    def exit_reason(self) -> str | None:
        return None

    def restart(self) -> None:
        """A new actor in place of a lost one: at the same epoch, with the calls the lost one
        had not answered submitted again, in order."""
        self._actors.kill(self._actor)
        self.losses += 1
        self._generation += 1
        self._actor = self._actors.spawn(self.config, self._generation)
        unanswered = [call.message for call in self.calls if not call.internal]
        self.calls.clear()
        if self.epoch:
            start = StartEpoch(self.epoch)
            self.calls.append(Call(start, self._actor.run.remote(start), internal=True))
        for message in unanswered:
            self.send(message)

    def end(self) -> None:
        self._actors.kill(self._actor)
        self.calls.clear()  # the replies die with their references
