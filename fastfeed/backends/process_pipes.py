"""The pipes a process worker shares with the main process: which ends each process uses, and
the descriptors multiprocessing keeps for a started process."""

from __future__ import annotations

from multiprocessing.process import BaseProcess
from typing import Any

from fastfeed import inherited_fds

__all__ = ["fds_for_process", "queue_of", "unused_ends"]


def queue_of(context: Any) -> Any:
    """A multiprocessing queue of ``context``, its pipe's files remembered for the workers
    forked later (:func:`fastfeed.inherited_fds.close_connection`)."""
    queue = context.Queue()
    inherited_fds.remember(queue._reader, queue._writer)
    return queue


def unused_ends(queue: Any, reading: bool = False, writing: bool = False) -> list[Any]:
    """The ends of a multiprocessing queue's pipe that a process never uses: every process
    that has a ``Queue`` holds both (its ``_reader`` and ``_writer``, the same since Python
    3.4), and a descriptor each is what the stock loader's processes pay."""
    return [end for end, unused in ((queue._reader, reading), (queue._writer, writing))
            if unused]


def fds_for_process(process: BaseProcess) -> tuple[int, ...]:
    """The descriptors the parent holds for a started process: its sentinel, and the end
    whose closing tells the process its parent is gone. multiprocessing keeps them only in
    the arguments of the finaliser that closes them (its ``Popen.finalizer``, the same since
    Python 3.8); none for the process being forked, which has no ``Popen`` yet."""
    finalizer = getattr(getattr(process, "_popen", None), "finalizer", None)
    arguments = getattr(finalizer, "_args", None)
    return tuple(arguments) if arguments else ()
