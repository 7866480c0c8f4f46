"""Stopping worker processes: join, then terminate, then kill, and only then say that none of
them can write shared memory any more."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess

from fastfeed.backends.interface import SHUTDOWN_GRACE

__all__ = ["stop_processes"]


def stop_processes(processes: Sequence[BaseProcess], grace: float,
                   then: Callable[[], None] | None = None) -> None:
    """Join the worker ``processes`` for up to ``grace`` seconds, terminate those still running
    and join them for up to :data:`SHUTDOWN_GRACE`, then kill any left; call ``then`` once every
    one is gone (a worker that outlives terminate() may still write).

    A killed worker the kernel has not ended yet (a busy machine) is joined on a thread of its
    own, which calls ``then``: unjoined, multiprocessing would keep its process object, and
    with it two descriptors, until the next worker starts.
    """
    try:
        _join(processes, grace)
    finally:
        for process in _running(processes):
            process.terminate()
        # Every one joined, even once exited (then at once): multiprocessing keeps each child
        # it has not joined, and its pipes, until some later start() in this process.
        _join(processes, SHUTDOWN_GRACE)
        killed = _running(processes)
        for process in killed:
            process.kill()
        if not killed:
            if then is not None:
                then()
        else:
            threading.Thread(target=_join_killed, args=(killed, then), name="fastfeed-reaper",
                             daemon=True).start()


def _join(processes: Sequence[BaseProcess], grace: float) -> None:
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))


def _running(processes: Sequence[BaseProcess]) -> list[BaseProcess]:
    return [process for process in processes if not _exited(process)]


def _join_killed(processes: Sequence[BaseProcess], then: Callable[[], None] | None) -> None:
    for process in processes:
        process.join()  # killed: the kernel ends it (but in uninterruptible sleep)
    if then is not None and not _running(processes):
        then()


def _exited(process: BaseProcess) -> bool:
    """Whether ``process`` is gone. Its exit code alone is not enough: when another
    ``waitpid`` in this process reaps the child first (seen in the leak tests, while the next
    epoch's workers start), multiprocessing's handle never learns the code."""
    if process.exitcode is not None:
        return True
    assert process.pid is not None
    try:
        os.kill(process.pid, 0)
    except ProcessLookupError:
        return True
    return False
