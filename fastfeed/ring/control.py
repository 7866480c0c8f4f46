"""A worker process's control pipe: the ring's slot announcements, one message each.

A :class:`~fastfeed.protocol.SlotAdded` carries the slot's file descriptor. The pipe is a Unix
socket pair, and each message is one ``sendmsg``: its pickled bytes, with the descriptor as
``SCM_RIGHTS`` ancillary data, so the receiver gets the message and its own descriptor for the
slot together (the message it is handed carries that descriptor, which it then owns).
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct

from fastfeed.protocol import SlotAdded, SlotDropped

__all__ = ["ControlPipe"]

_HEADER = struct.Struct("!I")  # the pickled message's length


class ControlPipe:
    """One end of a control pipe (picklable while a process is being started, as sockets are:
    the child gets a duplicate)."""

    def __init__(self, end: socket.socket) -> None:
        self._socket = end

    @classmethod
    def pair(cls) -> tuple[ControlPipe, ControlPipe]:
        """``(main end, worker end)``."""
        main, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return cls(main), cls(worker)

    def send(self, message: SlotAdded | SlotDropped) -> None:
        """Send ``message`` (and, for a ``SlotAdded``, its descriptor).

        Raises:
            OSError: the other end is closed (the worker exited).
        """
        payload = pickle.dumps(message)
        fds = [message.fd] if isinstance(message, SlotAdded) else []
        socket.send_fds(self._socket, [_HEADER.pack(len(payload)) + payload], fds,
                        socket.MSG_NOSIGNAL)

    def receive(self) -> SlotAdded | SlotDropped:
        """The next message, waiting for it.

        Raises:
            EOFError: the other end is closed.
        """
        # The descriptor comes with the first bytes of its message: read them with recvmsg.
        header, fds, _, _ = socket.recv_fds(self._socket, _HEADER.size, 1, socket.MSG_WAITALL)
        try:
            if len(header) < _HEADER.size:
                raise EOFError("the control pipe was closed")
            (length,) = _HEADER.unpack(header)
            message = pickle.loads(self._socket.recv(length, socket.MSG_WAITALL))
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
        poller = select.poll()
        poller.register(self._socket, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        self._socket.close()
