"""Process, file-descriptor and /dev/shm accounting for the leak and fault tests."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing
import os
import threading
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


def loader_processes() -> set[int]:
    """This process's live descendants but multiprocessing's helpers: a worker is a child of
    this process (fork, spawn) or of the forkserver (Python 3.14's default start method)."""
    return descendants() - {os.getpid()} - multiprocessing_helpers()[0]


def multiprocessing_helpers() -> tuple[set[int], set[str]]:
    """multiprocessing's helper processes (the forkserver, the resource tracker), each started
    once per process on first use and kept for its life, and this process's descriptors for
    them: not a loader's."""
    from multiprocessing import forkserver, resource_tracker

    server, tracker = forkserver._forkserver, resource_tracker._resource_tracker
    pids = {getattr(server, "_forkserver_pid", None), getattr(tracker, "_pid", None)}
    fds = {getattr(server, "_forkserver_alive_fd", None), getattr(tracker, "_fd", None)}
    return {p for p in pids if p}, {str(f) for f in fds if f is not None}


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


def descendants(pid: int | None = None) -> set[int]:
    """``pid`` (this process by default) and every live process below it."""
    tree = {os.getpid() if pid is None else pid}
    frontier = set(tree)
    while frontier:
        frontier = set().union(*(child_pids(p) for p in frontier)) - tree
        tree |= frontier
    return tree


def held_by_others(names: set[str]) -> set[str]:
    """Those /dev/shm ``names`` that a process outside this one's tree has open or mapped (a
    named semaphore is mapped): another test's, in a parallel run, or another program's.

    By inode: a semaphore is mapped under the temporary name it was created with."""
    inodes = {}
    for name in names:
        try:
            inodes[os.stat(f"/dev/shm/{name}").st_ino] = name
        except OSError:  # removed meanwhile
            continue
    ours = descendants()
    held = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in ours:
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                mapped = [line.split() for line in f if " /dev/shm/" in line]
            held.update(inodes.get(int(fields[4]), "") for fields in mapped)
            for fd in os.listdir(f"/proc/{entry}/fd"):
                link = f"/proc/{entry}/fd/{fd}"
                if os.readlink(link).startswith("/dev/shm/"):
                    held.add(inodes.get(os.stat(link).st_ino, ""))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return held & names


def snapshot() -> tuple[set[int], int, set[str]]:
    gc.collect()
    return loader_processes(), len(open_fds() - multiprocessing_helpers()[1]), shm_entries()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def new_shm(before: set[str]) -> set[str]:
    """The /dev/shm entries made since ``before`` that no other process tree holds."""
    made = shm_entries() - before
    return made - held_by_others(made) if made else made


def assert_no_leaks(before: tuple[set[int], int, set[str]], timeout: float = 10.0) -> None:
    """No new child process, no more fds, no new /dev/shm entry of this process's than at
    ``before`` (other processes, the tests beside this one in a parallel run among them, make
    and remove entries of their own meanwhile)."""
    children, fds, shm = before

    def settled() -> bool:
        gc.collect()
        now_children, now_fds, _ = snapshot()
        return now_children <= children and now_fds <= fds and not new_shm(shm)

    if not wait_until(settled, timeout):
        now_children, now_fds, _ = snapshot()
        raise AssertionError(
            f"leak: children {sorted(now_children - children)}, fds {fds} -> {now_fds} "
            f"({fd_targets()}), /dev/shm {sorted(new_shm(shm))}, threads "
            f"{sorted(t.name for t in threading.enumerate())}"
        )


def fd_targets() -> str:
    """What each open descriptor of this process is, for a leak's message."""
    targets = []
    for fd in sorted(open_fds(), key=int):
        with contextlib.suppress(OSError):
            targets.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
    return ", ".join(targets)
