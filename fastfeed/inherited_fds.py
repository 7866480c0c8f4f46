"""The descriptors a forked worker closes as it starts: those of the main process's loaders.

A forked process inherits every descriptor its parent holds. The stock loader's workers keep
them all, so every worker holds the pipes of every loader made before its own (30 two-worker
loaders: 10,321 descriptors across their workers), and a pipe stays open, in some worker, after
its owner closed it. fastfeed's workers close, as they start, what belongs to the pools of other
loaders and to their own pool's other workers: each object that holds such descriptors in the
main process registers here, and closes them in the child through the objects that hold them,
so that nothing closes the same number again later (by then perhaps a file the dataset opened).

Descriptors of the user's own (a file the dataset opened before the fork) are never touched.

A descriptor is closed in the child only while it is still the file it was made for: the
parent may have been closing it on another thread as the worker was forked (a queue's feeder
thread closes its pipe, then forgets the number), and the number may by then name whatever the
parent opened next, the worker's own queue among them. So each descriptor's file (device and
inode) is remembered as it is made, and compared before the close.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Collection
from multiprocessing.connection import Connection
from typing import Protocol

__all__ = ["File", "Inherited", "close_connection", "close_if_same", "file_of", "register",
           "release_inherited", "remember"]


class Inherited(Protocol):
    """An object of the main process that holds descriptors a forked worker does not need."""

    def release_inherited(self, keep: Collection[object]) -> None:
        """In a forked worker: close what this object holds, but for the objects in ``keep``
        (the worker's own queues) the ends the worker uses. Takes no lock: another thread of
        the parent may have held it as the worker was forked."""
        ...


_owners: weakref.WeakSet[Inherited] = weakref.WeakSet()


def register(owner: Inherited) -> None:
    """Have forked workers close ``owner``'s descriptors (for as long as it lives)."""
    _owners.add(owner)


def release_inherited(keep: Collection[object]) -> None:
    """In a worker process, first thing: close every registered owner's descriptors but the
    worker's own (nothing is registered in a spawned worker)."""
    for owner in list(_owners):
        owner.release_inherited(keep)


File = tuple[int, int]  # a descriptor's file: its device and inode

_files: weakref.WeakKeyDictionary[Connection, File] = weakref.WeakKeyDictionary()


def file_of(fd: int) -> File:
    """The file descriptor ``fd`` is open on, for :func:`close_if_same` in a forked worker."""
    status = os.fstat(fd)
    return status.st_dev, status.st_ino


def close_if_same(fd: int, file: File | None) -> None:
    """In a forked worker: close the inherited ``fd`` if it is still ``file`` (see the
    module's notes)."""
    try:
        if file is not None and file_of(fd) == file:
            os.close(fd)
    except OSError:  # closed in the parent since: nothing to close
        pass


def remember(*connections: Connection) -> None:
    """Note the file of each of ``connections`` (just made), for :func:`close_connection`."""
    for connection in connections:
        _files[connection] = file_of(connection.fileno())


def close_connection(connection: Connection) -> None:
    """In a forked worker: close an inherited ``connection`` of the parent's, if its
    descriptor is still the file :func:`remember` noted. Either way, the connection forgets
    the number, so that it never closes it later."""
    fd, connection._handle = connection._handle, None  # type: ignore[attr-defined]
    if fd is not None:
        close_if_same(fd, _files.get(connection))
