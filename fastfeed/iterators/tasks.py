"""The task book: every task of an epoch and its state, with the transitions it allows.

A task is one index batch sent to a worker::

    IN_FLIGHT ──answer──> ANSWERED ──deliver──> DELIVERED
        └──cancel (its worker's replica ended first)──> CANCELLED

Ordering, replica cancellation, the resume position and the count of outstanding work all
derive from the book; it touches no process, queue or slot, so it is tested without them. A
task holds its slot's ticket until :meth:`Entry.take_ticket` hands it over, exactly once.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Entry", "TaskBook", "TaskState"]


class TaskState(enum.Enum):
    IN_FLIGHT = "in flight"
    ANSWERED = "answered"
    DELIVERED = "delivered"
    CANCELLED = "cancelled"


@dataclass(eq=False)
class Entry:
    """One task: its worker, its slot's ticket while it holds one, and once answered, what
    to deliver (a batch, or an error to raise in its turn)."""

    seq: int
    worker_id: int
    ticket: Any
    state: TaskState = TaskState.IN_FLIGHT
    result: Any = field(default=None, repr=False)
    dataset_state: Any = field(default=None, repr=False)

    def take_ticket(self) -> Any:
        """The ticket, handed over once (to become a lease, or to be released)."""
        ticket, self.ticket = self.ticket, None
        return ticket


class TaskBook:
    """The tasks of the current epoch, by sequence number (the sampler's order)."""

    def __init__(self) -> None:
        self.start_epoch()

    def start_epoch(self) -> None:
        """Forget the last epoch; the caller has settled every task of it."""
        self._entries: dict[int, Entry] = {}
        self._sent = 0  # the next sequence number
        self._next = 0  # the first sequence number not yet delivered or cancelled
        # answered, in order of arrival
        self._arrivals: collections.deque[int] = collections.deque()
        self._in_flight: collections.Counter[int] = collections.Counter()  # per worker

    # -- counts ------------------------------------------------------------------------------
    def outstanding(self, worker_id: int | None = None) -> int:
        """Tasks sent and not answered (of one worker, or of all)."""
        if worker_id is None:
            return sum(self._in_flight.values())
        return self._in_flight[worker_id]

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, seq: int) -> Entry:
        return self._entries[seq]

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    # -- transitions -------------------------------------------------------------------------
    def send(self, worker_id: int, ticket: Any) -> int:
        """Book a task sent to ``worker_id``; return its sequence number."""
        seq = self._sent
        self._entries[seq] = Entry(seq, worker_id, ticket)
        self._in_flight[worker_id] += 1
        self._sent += 1
        return seq

    def answer(self, seq: int) -> Entry:
        """The worker answered task ``seq``; fill in the returned entry's result."""
        entry = self._entries[seq]
        assert entry.state is TaskState.IN_FLIGHT, entry
        entry.state = TaskState.ANSWERED
        self._in_flight[entry.worker_id] -= 1
        self._arrivals.append(seq)
        return entry

    def cancel_worker(self, worker_id: int) -> list[Entry]:
        """Cancel every task of ``worker_id`` still in flight (its replica ended: those queued
        behind never run); return them, with their tickets still to settle."""
        cancelled = [e for e in self._entries.values()
                     if e.worker_id == worker_id and e.state is TaskState.IN_FLIGHT]
        for entry in cancelled:
            entry.state = TaskState.CANCELLED
            self._in_flight[worker_id] -= 1
        return cancelled

    def deliver(self, in_order: bool) -> Entry | None:
        """The next answered task to hand to the consumer (in sampler order, or in order of
        arrival), now DELIVERED; None while it is still in flight."""
        self._skip_settled()
        if in_order:
            entry = self._entries.get(self._next)
            if entry is None or entry.state is not TaskState.ANSWERED:
                return None
        else:
            entry = None
            while self._arrivals and entry is None:
                candidate = self._entries.get(self._arrivals.popleft())
                if candidate is not None and candidate.state is TaskState.ANSWERED:
                    entry = candidate
            if entry is None:
                return None
        entry.state = TaskState.DELIVERED
        del self._entries[entry.seq]
        self._skip_settled()
        return entry

    @property
    def finished(self) -> bool:
        """Every task sent was delivered or cancelled."""
        self._skip_settled()
        return self._next == self._sent

    def _skip_settled(self) -> None:
        while self._next < self._sent:
            entry = self._entries.get(self._next)
            if entry is not None and entry.state is not TaskState.CANCELLED:
                return
            self._entries.pop(self._next, None)
            self._next += 1

    # -- the resume position -----------------------------------------------------------------
    def upcoming(self) -> tuple[int, int | None]:
        """``(seq, worker)`` of the next batch the consumer will get in sampler order (the
        worker is None when no task is pending: the next one is not sent yet)."""
        pending = [e for e in self._entries.values()
                   if e.seq >= self._next and e.state is not TaskState.CANCELLED]
        if not pending:
            return self._sent, None
        first = min(pending, key=lambda e: e.seq)
        return first.seq, first.worker_id

    def take_tickets(self) -> list[Any]:
        """Every ticket tasks still hold (the pool is shutting down)."""
        return [t for e in self._entries.values() if (t := e.take_ticket()) is not None]
