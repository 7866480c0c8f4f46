"""Machine facts: the cores this process may use, and (from Linux's /proc) available memory,
this process's RSS, idle cores and how much given threads sleep; None off Linux."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

__all__ = ["CpuMeter", "WorkerSleepMeter", "available_cpus", "available_memory", "read_kib",
           "resident_memory"]


def read_kib(path: str, field: str) -> int | None:
    """Bytes of a ``field:  N kB`` line of a /proc file (None when it cannot be read)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory() -> int | None:
    """Bytes the kernel reports as available (``MemAvailable``)."""
    return read_kib("/proc/meminfo", "MemAvailable")


def resident_memory() -> int | None:
    """This process's resident set size in bytes."""
    return read_kib("/proc/self/status", "VmRSS")


def available_cpus() -> int:
    """Cores this process may run on (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class CpuMeter:
    """Idle cores between two readings of /proc/stat (None where it is unreadable)."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                values = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        return idle, sum(values)

    def idle_cores(self) -> float | None:
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or now[1] <= last[1]:
            return None
        return (now[0] - last[0]) / (now[1] - last[1]) * (os.cpu_count() or 1)


class WorkerSleepMeter:
    """The workers' share of wall time spent neither running nor waiting for a core, between
    two readings of ``/proc/<task>/schedstat`` (Linux; None where unreadable).

    What tells I/O-bound workers from CPU-bound ones on a busy machine: a worker that waits on
    storage sleeps; a CPU-bound one runs, or waits in the run queue when other processes hold
    the cores, and neither counts as sleep. Idle-cores readings cannot tell them apart there,
    and throughput alone cannot either: more CPU-bound workers than cores do raise throughput
    on a shared machine, by taking the cores from other users' processes.

    A task is one thread: a worker process is measured by its main thread, which runs the
    dataset and the collate (one read per worker). Its wait for threads a dataset starts
    itself, and a thread worker's wait for the GIL, read as sleep: that errs towards more
    workers, where the throughput verdict still decides.

    Args:
        tasks: tasks to take a first reading of, so that the first
            :meth:`sleep_fraction` measures them.
    """

    def __init__(self, tasks: Iterable[int] = ()) -> None:
        self._last = self._read(tasks)

    @staticmethod
    def _read(tasks: Iterable[int]) -> dict[int, tuple[int, float]]:
        """task -> (ns running or in the run queue, wall s), for the tasks still there."""
        now = time.monotonic()
        readings = {}
        for task in tasks:
            try:
                with open(f"/proc/{task}/schedstat") as f:
                    on_cpu, run_queue = (int(v) for v in f.read().split()[:2])
            except (OSError, ValueError):
                continue  # the worker exited (retired, or at the end of its epoch)
            readings[task] = (on_cpu + run_queue, now)
        return readings

    def sleep_fraction(self, tasks: Iterable[int]) -> float | None:
        """Sleep share of ``tasks`` (worker pids, or native thread ids of thread workers)
        since the last reading; tasks first seen now start their measurement."""
        readings = self._read(tasks)
        busy = wall = 0.0
        for task, (ns, now) in readings.items():
            if task in self._last:
                last_ns, last_time = self._last[task]
                busy += (ns - last_ns) / 1e9
                wall += now - last_time
        self._last = readings
        if wall <= 0:
            return None
        return min(1.0, max(0.0, 1 - busy / wall))
