"""Process, file-descriptor and /dev/shm accounting for the leak and fault tests."""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import time

# The worker pool's shutdown flag is a RawValue from multiprocessing's shared heap, whose arena
# (one /dev/shm file, unlinked, held open) is created on first use and then reused for the
# life of the process. Create it now, so that a leak check is not tripped by that one-time
# allocation when a test runs on its own.
_HEAP_ARENA = multiprocessing.RawValue(ctypes.c_bool, False)


def child_pids(pid: int | None = None) -> set[int]:
    """Live (non-zombie) children of ``pid``, read from /proc."""
    pid = os.getpid() if pid is None else pid
    children = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.add(int(entry))
    return children


def rss_kb(pid: int | str = "self") -> int:
    """Resident set size of ``pid`` in KiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def snapshot() -> tuple[set[int], int, set[str]]:
    gc.collect()
    return child_pids(), len(open_fds()), shm_entries()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def assert_no_leaks(before: tuple[set[int], int, set[str]], timeout: float = 10.0) -> None:
    """No new child process, no more fds, no new /dev/shm entry than at ``before``."""
    children, fds, shm = before

    def settled() -> bool:
        gc.collect()
        now_children, now_fds, now_shm = snapshot()
        return now_children <= children and now_fds <= fds and now_shm <= shm

    if not wait_until(settled, timeout):
        now_children, now_fds, now_shm = snapshot()
        raise AssertionError(
            f"leak: children {sorted(now_children - children)}, fds {fds} -> {now_fds}, "
            f"/dev/shm {sorted(now_shm - shm)}"
        )
