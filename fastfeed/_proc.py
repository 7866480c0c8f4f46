"""Machine facts: the cores this process may use, and (from Linux's /proc) available memory
and this process's RSS, None off Linux."""

from __future__ import annotations

import os

__all__ = ["available_cpus", "available_memory", "read_kib", "resident_memory"]


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
