"""What every worker backend shares."""

from __future__ import annotations

__all__ = ["WorkerExited"]


class WorkerExited(RuntimeError):
    """A worker that should be running is gone (the message names it and why)."""
