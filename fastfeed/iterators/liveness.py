"""Waiting for the workers' next message without ever hanging on a dead worker.

While the main process waits it checks, every ``_LIVENESS_INTERVAL``, that every worker that
should be running still is, and honours the loader's ``timeout``, as torch does.
"""

from __future__ import annotations

import queue
import threading
import time

from fastfeed.backends import WorkerBackend, WorkerExited
from fastfeed.iterators.workers import WorkerState, WorkerTable
from fastfeed.protocol import FromWorker

__all__ = ["WaitInterrupted", "next_answer", "raise_if_a_worker_died"]

# How often a waiting main process checks that its workers are alive.
_LIVENESS_INTERVAL = 0.1


class WaitInterrupted(Exception):
    """The wait for the workers was given up from another thread (see
    :meth:`fastfeed.iterators.base_iterator.BaseIterator.waits_interrupted`)."""


def raise_if_a_worker_died(workers: WorkerTable, wait: float = 0.0) -> None:
    """Raise :class:`WorkerExited` if a worker that should be running has exited, waiting up
    to ``wait`` seconds for one that is dying. Only a STOPPED worker may exit."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and all(
        w.handle.exit_reason() is None for w in workers
    ):
        time.sleep(0.02)
    for worker in workers:
        reason = worker.handle.exit_reason()
        if reason is not None and worker.state is not WorkerState.STOPPED:
            handle = worker.handle
            raise WorkerExited(f"DataLoader worker {handle.worker_id} (pid {handle.pid}) exited "
                               f"unexpectedly: {reason}")


def next_answer(backend: WorkerBackend, workers: WorkerTable, timeout: float,
                interrupt: threading.Event | None = None) -> FromWorker:
    """The next message of ``backend``'s workers.

    Raises:
        WorkerExited: a worker died.
        RuntimeError: nothing came for ``timeout`` seconds (when ``timeout > 0``).
        WaitInterrupted: ``interrupt`` was set (checked as often as liveness).
    """
    deadline = time.monotonic() + timeout if timeout > 0 else None
    while True:
        if interrupt is not None and interrupt.is_set():
            raise WaitInterrupted
        wait = _LIVENESS_INTERVAL
        if deadline is not None:
            wait = max(0.0, min(wait, deadline - time.monotonic()))
        try:
            return backend.next_answer(wait)
        except queue.Empty:
            pass
        raise_if_a_worker_died(workers)
        if deadline is not None and time.monotonic() >= deadline:
            raise RuntimeError(f"DataLoader timed out after {timeout} seconds")
