"""Processes and cores, from Linux's /proc: CPU time, waiting for a CPU and memory of the
training process and its workers, and what the machine's cores did meanwhile. Read twice,
when the window opens and when it closes: nothing per step. Off Linux (no /proc) every figure
is missing and the report says so.

A window can outlive the workers in it: a loader without persistent workers starts new ones
every epoch, and those of a short epoch start and end within the window. Their CPU time is
not lost when they end: the kernel adds a process's time, and its own children's, to its
parent's when the parent waits for it (``cutime``, ``cstime``), so the time of a process tree
is its live (and zombie) members' own time plus what each has collected from the children it
waited for. That sum only grows, whichever workers came and went in between.

The tree is found from the kernel's lists of each process's children, not by reading every
process of the machine: the reading at the window's open takes about a millisecond, during
which the workers run ahead of the script.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from fastfeed._proc import read_kib

__all__ = ["ProcessTimes", "ProcessTree", "ThreadRunDelay", "Usage", "machine_busy_s",
           "process_group", "usage_between"]

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# /proc/stat's columns after the CPU's name: those not counted as in use are idle and iowait.
_IDLE_COLUMNS = (3, 4)
# The share of the cores in use from which the report calls them all busy.
SATURATED = 0.9
# The share of their time workers spend on a CPU or waiting for one from which they are
# CPU-bound: they rarely sleep (on I/O, a lock, an empty task queue).
CPU_BOUND = 0.75


def _fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or ``None`` for a
    process that is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _pids() -> set[int]:
    return {int(e) for e in os.listdir("/proc") if e.isdigit()} if os.path.isdir("/proc") else set()


def _children(pid: int) -> list[int]:
    """The children of ``pid`` (zombies included), from each of its threads' list."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children = []
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children += [int(child) for child in f.read().split()]
        except OSError:  # the thread has ended
            continue
    return children


# Kernels built without CONFIG_PROC_CHILDREN have no children lists: every process is read.
_CHILDREN_LISTED = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def _family(root: int) -> set[int]:
    """``root`` and its descendants: from the children lists where the kernel keeps them (a
    few files), else from every process's parent."""
    children_of: Callable[[int], list[int]] = _children
    if not _CHILDREN_LISTED:
        parents = {pid: int(f[1]) for pid in _pids() if (f := _fields(pid)) is not None}
        children_of = lambda parent: [pid for pid, p in parents.items() if p == parent]  # noqa: E731
    family, frontier = {root}, [root]
    while frontier:
        children = children_of(frontier.pop())
        family.update(children)
        frontier.extend(children)
    return family


def process_group(pgid: int) -> list[int]:
    """The live processes of a process group."""
    return [pid for pid in _pids()
            if (f := _fields(pid)) is not None and f[0] != "Z" and int(f[2]) == pgid]


def _memory(pid: int) -> int:
    """Proportional set size in bytes (shared pages split among their users, so a forked
    worker is not charged for the parent's pages it only reads); resident size where the
    kernel has no smaps_rollup; 0 for a process that is gone."""
    pss = read_kib(f"/proc/{pid}/smaps_rollup", "Pss")
    return pss if pss is not None else read_kib(f"/proc/{pid}/status", "VmRSS") or 0


def _run_delay_s(pid: int) -> float | None:
    """Seconds the threads of ``pid`` have spent runnable but waiting for a CPU (the second
    field of each thread's schedstat); ``None`` where the kernel does not keep it."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return total / 1e9


class ThreadRunDelay:
    """Seconds the calling thread has spent runnable but waiting for a CPU, so far: read
    from its schedstat, kept open (a read costs about a microsecond). 0 where the kernel
    does not keep it. Made and read in one thread; :meth:`close` when done."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def __call__(self) -> float:
        if self._fd is None:
            return 0.0
        try:
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _uptime_s() -> float | None:
    try:
        with open("/proc/uptime") as f:
            return float(f.read().split()[0])
    except OSError:
        return None


def machine_busy_s(cpus: set[int] | None = None, path: str = "/proc/stat") -> float | None:
    """CPU seconds every process on the machine has used, on the cores ``cpus`` (default:
    those this process may run on), since boot: what is not idle or waiting for I/O, steal
    time included (a virtual machine's core given to another guest is not this one's)."""
    cpus = os.sched_getaffinity(0) if cpus is None and hasattr(os, "sched_getaffinity") else cpus
    busy = 0
    try:
        with open(path) as f:
            for line in f:
                name, *columns = line.split()
                if not name.startswith("cpu") or name == "cpu":
                    continue
                if cpus is not None and int(name[3:]) not in cpus:
                    continue
                values = [int(v) for v in columns[:8]]
                busy += sum(v for i, v in enumerate(values) if i not in _IDLE_COLUMNS)
    except (OSError, ValueError):
        return None
    return busy / _TICKS


@dataclass(frozen=True)
class ProcessTimes:
    """One process of a tree, as /proc gave it.

    Attributes:
        started: when it started, in seconds after boot (a reused pid is another process).
        cpu_s: user and system time of its threads.
        reaped_s: user and system time of the children it has waited for, theirs included.
        run_delay_s: time its threads were runnable but waiting for a CPU (``None``: unknown).
        zombie: it has ended, and its parent has not waited for it yet.
        helper: multiprocessing's forkserver or resource tracker, no worker: started once per
            process with the forkserver or spawn start method (Python 3.14's default on
            Linux is forkserver, whose children the workers then are).
    """

    started: float
    cpu_s: float
    reaped_s: float
    run_delay_s: float | None
    zombie: bool
    helper: bool = False


_READ_TRIES = 3


def _times(pid: int) -> ProcessTimes | None:
    f = _fields(pid)
    if f is None:
        return None
    zombie = f[0] == "Z"
    return ProcessTimes(started=int(f[19]) / _TICKS,
                        cpu_s=(int(f[11]) + int(f[12])) / _TICKS,  # utime + stime
                        reaped_s=(int(f[13]) + int(f[14])) / _TICKS,  # cutime + cstime
                        run_delay_s=None if zombie else _run_delay_s(pid), zombie=zombie,
                        helper=not zombie and _started_as_helper(pid)
                        and not _started_as_helper(int(f[1])))


# How multiprocessing starts its helper processes: ``python -c 'from multiprocessing.forkserver
# import main; ...'`` (resource_tracker likewise). The forkserver's children, the workers, are
# forks of it with the same command line: a helper is the process whose parent's differs.
_HELPERS = (b"multiprocessing.forkserver", b"multiprocessing.resource_tracker")


def _started_as_helper(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
    except OSError:
        return False
    return any(helper in command for helper in _HELPERS)


@dataclass(frozen=True)
class ProcessTree:
    """A reading of a process and its descendants, and of the machine's cores, at one time.

    Attributes:
        root: the process the tree descends from.
        processes: its members, zombies included.
        memory: bytes of each live member (PSS).
        machine_busy_s: :func:`machine_busy_s` at the reading.
        at: seconds after boot at the reading (``None`` off Linux).
    """

    root: int
    processes: dict[int, ProcessTimes]
    memory: dict[int, int]
    machine_busy_s: float | None
    at: float | None

    @classmethod
    def read(cls, root: int | None = None, memory: bool = True) -> ProcessTree:
        """Read the tree of ``root`` (default: this process), with each live member's memory
        if ``memory``. A child its parent waits for between the reading of the two would be
        counted twice or not at all: the reading is taken again (up to :data:`_READ_TRIES`
        times) when the tree changed while it was read."""
        root = os.getpid() if root is None else root
        for _ in range(_READ_TRIES):
            at, family = _uptime_s(), _family(root)
            members = {pid: t for pid in family if (t := _times(pid)) is not None}
            if len(members) == len(family) and _family(root) == family:
                break
        return cls(root, members,
                   {pid: _memory(pid) for pid, t in members.items() if not t.zombie}
                   if memory else {},
                   machine_busy_s(), at)

    def total_cpu_s(self) -> float:
        """CPU seconds of the tree and of every descendant that has ended and been waited
        for: what the tree has used since it started."""
        return sum(t.cpu_s + t.reaped_s for t in self.processes.values())

    def workers(self) -> list[int]:
        """The live descendants but multiprocessing's helpers: the loader's worker processes,
        as a rule (children of the forkserver where it starts them)."""
        return [pid for pid, t in self.processes.items()
                if pid != self.root and not t.zombie and not t.helper]


@dataclass(frozen=True)
class Usage:
    """What the process tree, and the machine, used over a window.

    Attributes:
        cores_used: CPU seconds of the tree (its processes that ended within the window
            included) per second of wall time.
        machine_cores_used: likewise for every process on the cores this one may use.
        worker_processes: live descendants at the window's end.
        workers_cpu_s: CPU seconds of the descendants (those that ended included).
        worker_busy: ``workers_cpu_s`` per live descendant per second.
        worker_waiting: share of their time in the window the live descendants spent runnable
            but waiting for a CPU.
        main_memory_mb, workers_memory_mb: PSS at the window's end.
    """

    cores_used: float | None
    machine_cores_used: float | None
    worker_processes: int
    workers_cpu_s: float | None
    worker_busy: float | None
    worker_waiting: float | None
    main_memory_mb: float | None
    workers_memory_mb: float | None


def _waiting(start: ProcessTree, end: ProcessTree, workers: list[int]) -> float | None:
    """The share of the live workers' time in the window spent waiting for a CPU."""
    if start.at is None or end.at is None or not workers:
        return None
    waited = lived = 0.0
    for pid in workers:
        now, before = end.processes[pid], start.processes.get(pid)
        if now.run_delay_s is None:
            return None
        # A worker started within the window waited only since it started.
        since = (before.run_delay_s if before is not None and before.started == now.started
                 else None)
        waited += now.run_delay_s - (since or 0.0)
        lived += end.at - max(start.at, now.started)
    return min(1.0, max(0.0, waited / lived)) if lived > 0 else None


def usage_between(start: ProcessTree, end: ProcessTree, seconds: float) -> Usage:
    """Usage over ``seconds`` between two readings of the same tree."""
    if seconds <= 0 or start.root not in end.processes:
        return Usage(None, None, 0, None, None, None, None, None)
    tree_cpu = end.total_cpu_s() - start.total_cpu_s()
    main = end.processes[end.root].cpu_s - start.processes[start.root].cpu_s
    workers = end.workers()
    machine = (None if start.machine_busy_s is None or end.machine_busy_s is None
               else (end.machine_busy_s - start.machine_busy_s) / seconds)
    return Usage(
        cores_used=tree_cpu / seconds,
        machine_cores_used=machine,
        worker_processes=len(workers),
        workers_cpu_s=tree_cpu - main,
        worker_busy=(tree_cpu - main) / (seconds * len(workers)) if workers else None,
        worker_waiting=_waiting(start, end, workers),
        main_memory_mb=end.memory[end.root] / 2**20,
        workers_memory_mb=sum(end.memory[pid] for pid in workers) / 2**20 if workers else None,
    )
