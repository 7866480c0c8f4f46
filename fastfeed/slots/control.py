"""A worker process's control pipe: the slot pool's slot announcements, one message each.

A :class:`~fastfeed.protocol.SlotAdded` carries the slot's file descriptor. The pipe is a Unix
socket pair, and each message is one ``sendmsg``: its pickled bytes, with the descriptor as
``SCM_RIGHTS`` ancillary data, so the receiver gets the message and its own descriptor for the
slot together (the message it is handed carries that descriptor, which it then owns).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import struct
from collections.abc import Iterator
from multiprocessing.connection import Connection

from fastfeed import inherited_fds
from fastfeed.protocol import SlotAdded, SlotDropped

__all__ = ["ControlPipe"]

_HEADER = struct.Struct("!I")  # the pickled message's length


@contextlib.contextmanager
def _socket(end: Connection) -> Iterator[socket.socket]:
    """``end``'s descriptor as a socket, for the calls that take ancillary data; ``end`` keeps
    owning it."""
    sock = socket.socket(fileno=end.fileno())
    try:
        yield sock
    finally:
        sock.detach()


class ControlPipe:
    """One end of a control pipe.

    Its descriptor is held by a multiprocessing ``Connection``, which gives it that class's
    life: a duplicate for a child it is handed to as the child starts (spawn, forkserver),
    and a quiet close when it is dropped unclosed (a reaper lets reference counting close
    what it holds).
    """

    def __init__(self, end: Connection) -> None:
        self._end = end

    @classmethod
    def pair(cls) -> tuple[ControlPipe, ControlPipe]:
        """``(main end, worker end)``."""
        main, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ends = Connection(main.detach()), Connection(worker.detach())
        inherited_fds.remember(*ends)
        return cls(ends[0]), cls(ends[1])

    def send(self, message: SlotAdded | SlotDropped) -> None:
        """Send ``message`` (and, for a ``SlotAdded``, its descriptor).

        Raises:
            OSError: the other end is closed (the worker exited).
        """
        payload = pickle.dumps(message)
        fds = [message.fd] if isinstance(message, SlotAdded) else []
        with _socket(self._end) as sock:
            socket.send_fds(sock, [_HEADER.pack(len(payload)) + payload], fds,
                            socket.MSG_NOSIGNAL)

    def receive(self) -> SlotAdded | SlotDropped:
        """The next message, waiting for it.

        Raises:
            EOFError: the other end is closed.
        """
        with _socket(self._end) as sock:
            # The descriptor comes with the first bytes of its message: read them with recvmsg.
            header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 1, socket.MSG_WAITALL)
            try:
                if len(header) < _HEADER.size:
                    raise EOFError("the control pipe was closed")
                (length,) = _HEADER.unpack(header)
                message = pickle.loads(sock.recv(length, socket.MSG_WAITALL))
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
        if isinstance(message, SlotAdded):
            (fd,) = fds
            return SlotAdded(message.slot_id, message.nbytes, fd)
        return message

    def poll(self) -> bool:
        """Whether a message is waiting."""
        return self._end.poll()

    def close(self) -> None:
        self._end.close()

    def release_inherited(self) -> None:
        """In a forked worker: close this end, inherited (see :mod:`fastfeed.inherited_fds`)."""
        inherited_fds.close_connection(self._end)
