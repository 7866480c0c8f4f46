"""What the backends whose workers run on this machine's cores (processes, threads) share."""

from __future__ import annotations

from typing import Any, ClassVar

from fastfeed.autotune import initial_workers
from fastfeed.codec import decode_if_encoded
from fastfeed.protocol import FromWorker, ToWorker
from fastfeed.slots import Lease

__all__ = ["OnThisMachine", "QueueFedWorker"]


class OnThisMachine:
    """What the backends whose workers run on this machine's cores share: they take no
    placement, ``num_workers="auto"`` starts from this machine's cores and memory, answers
    come on one queue, and a batch written into a slot is rebuilt over it (any other, from a
    thread or without a slot pool, is the batch)."""

    name: ClassVar[str]
    _results: Any  # the queue every worker answers on

    @classmethod
    def refusal(cls, dataset: Any, deterministic: bool) -> str | None:
        return None

    @classmethod
    def placement(cls, ray_options: dict[str, Any] | None) -> dict[str, Any] | None:
        if ray_options is not None:
            raise ValueError("ray_options places Ray actors: it needs worker_mode='ray'")
        return None

    @classmethod
    def worker_bounds(cls, placement: dict[str, Any] | None) -> tuple[int, int]:
        return initial_workers()

    def next_answer(self, timeout: float) -> FromWorker:
        return self._results.get(timeout=timeout)

    def rebuild(self, batch: Any, lease: Lease | None) -> Any:
        return decode_if_encoded(batch, lease)


class QueueFedWorker:
    """A worker that takes its messages from a queue: a process's (shared with it) or a
    thread's."""

    task_queue: Any

    def send(self, message: ToWorker) -> None:
        self.task_queue.put(message)
