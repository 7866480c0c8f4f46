"""Processes, from Linux's /proc: CPU time and memory of the training process and its workers
(read twice, when the window opens and when it closes: nothing per step), and the members of a
process group. Off Linux (no /proc) every figure is missing and the report says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fastfeed._proc import read_kib

__all__ = ["ProcessTree", "Usage", "process_group", "usage_between"]

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or ``None`` for a
    process that is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields


def _pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()] if os.path.isdir("/proc") else []


def process_group(pgid: int) -> list[int]:
    """The live processes of a process group."""
    return [pid for pid in _pids() if (f := _fields(pid)) is not None and int(f[2]) == pgid]


def _memory(pid: int) -> int:
    """Proportional set size in bytes (shared pages split among their users, so a forked
    worker is not charged for the parent's pages it only reads); resident size where the
    kernel has no smaps_rollup; 0 for a process that is gone."""
    pss = read_kib(f"/proc/{pid}/smaps_rollup", "Pss")
    return pss if pss is not None else read_kib(f"/proc/{pid}/status", "VmRSS") or 0


@dataclass(frozen=True)
class ProcessTree:
    """A reading of a process and its descendants: CPU seconds and memory of each."""

    root: int
    cpu_s: dict[int, float]
    memory: dict[int, int]

    @classmethod
    def read(cls, root: int | None = None) -> ProcessTree:
        root = os.getpid() if root is None else root
        stats: dict[int, tuple[int, float]] = {}  # pid: (parent, CPU seconds)
        for pid in _pids():
            if (f := _fields(pid)) is not None:
                stats[pid] = int(f[1]), (int(f[11]) + int(f[12])) / _TICKS  # utime + stime
        family, frontier = {root}, [root]
        while frontier:
            parent = frontier.pop()
            children = [pid for pid, (ppid, _) in stats.items() if ppid == parent]
            family.update(children)
            frontier.extend(children)
        cpu = {pid: stats[pid][1] for pid in family if pid in stats}
        return cls(root, cpu, {pid: _memory(pid) for pid in cpu})


@dataclass(frozen=True)
class Usage:
    """What the process tree used over a window."""

    cores_used: float | None  # CPU seconds of the whole tree per second of wall time
    worker_processes: int
    worker_busy: float | None  # the workers' CPU seconds per worker per second
    main_memory_mb: float | None
    workers_memory_mb: float | None


def usage_between(start: ProcessTree, end: ProcessTree, seconds: float) -> Usage:
    """Usage over ``seconds`` between two readings of the same tree. A worker that started
    within the window is charged from zero; one that ended within it is not counted."""
    if seconds <= 0 or start.root not in end.cpu_s:
        return Usage(None, 0, None, None, None)
    used = {pid: cpu - start.cpu_s.get(pid, 0.0) for pid, cpu in end.cpu_s.items()}
    workers = [pid for pid in used if pid != end.root]
    worker_cpu = sum(used[pid] for pid in workers)
    return Usage(
        cores_used=sum(used.values()) / seconds,
        worker_processes=len(workers),
        worker_busy=worker_cpu / (seconds * len(workers)) if workers else None,
        main_memory_mb=end.memory[end.root] / 2**20,
        workers_memory_mb=sum(end.memory[pid] for pid in workers) / 2**20 if workers else None,
    )
