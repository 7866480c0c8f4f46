"""Whether the loader's main process still lives, as a worker sees it.

A worker must leave once its main process is gone (killed, crashed), or it would hold its
memory and cores forever. A worker started by fork or spawn is the main process's child, and
sees it go when it is reparented. A ``forkserver`` worker (Python 3.14's default on Linux) is the
server's child, and the server outlives the main process for as long as any worker lives (each
holds the server's "alive" pipe), so its parent never changes: it watches the main process
itself, by a pidfd where Linux has one (readable once the process has ended, whatever reuses
its pid later), else by its pid.
"""

from __future__ import annotations

import contextlib
import os
import select

__all__ = ["MainProcess"]


class MainProcess:
    """The main process with pid ``pid``, watched from a worker; in that process itself (a
    worker thread) it always lives."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._in_it = pid == os.getpid()
        self._is_parent = os.getppid() == pid
        self._pidfd: int | None = None
        if not (self._in_it or self._is_parent):
            # Without one (not Linux >= 5.3, or it has ended already), the pid is watched.
            with contextlib.suppress(AttributeError, OSError):
                self._pidfd = os.pidfd_open(pid)

    def alive(self) -> bool:
        if self._in_it:
            return True
        if self._is_parent:
            return os.getppid() == self.pid
        if self._pidfd is not None:
            readable, _, _ = select.select([self._pidfd], [], [], 0)
            return not readable
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a process of another user has its pid: ours has ended
            return False
        return True
