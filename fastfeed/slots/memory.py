"""Shared-memory slots as both sides of the slot pool see them: anonymous ``memfd`` mappings.

A ``memfd`` has no name in ``/dev/shm``, so a killed process can never leave one behind, and
Docker's small default ``/dev/shm`` does not limit it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

__all__ = ["ALIGN", "map_memfd", "map_slot", "new_memfd", "round_up", "slots_supported"]

# Every array in a slot starts on a cache line.
ALIGN = 64


def slots_supported() -> bool:
    """Return whether this platform can build a slot pool (Linux ``memfd_create``)."""
    return hasattr(os, "memfd_create")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def new_memfd(name: str, nbytes: int) -> int:
    """A new anonymous file of ``nbytes``; the caller owns the descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_memfd(fd: int, nbytes: int, *, writable: bool = True, populate: bool = False
              ) -> memoryview:
    """Map ``nbytes`` of ``fd`` shared, as bytes (numpy and torch take them with
    ``frombuffer``) that are unmapped once nothing views them any more.

    The mapping holds no descriptor: Python's ``mmap`` keeps a duplicate of ``fd`` for as long
    as the mapping lives (before 3.13), one more descriptor per slot in every process that maps
    it, which the main process and each worker would then hold beside the stock loader's.
    """
    protection = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    address = _libc.mmap(None, nbytes, protection, flags, fd, 0)
    if address == _MAP_FAILED:
        error = ctypes.get_errno()
        raise OSError(error, f"mmap of {nbytes} bytes failed: {os.strerror(error)}")
    buffer = (ctypes.c_ubyte * nbytes).from_address(address)
    weakref.finalize(buffer, _libc.munmap, address, nbytes).atexit = False
    return memoryview(buffer).cast("B")


def map_slot(fd: int, nbytes: int, populate: bool = False) -> memoryview:
    """Map a slot. ``populate`` (workers, which write every slot sooner or later) maps all
    of its pages now, in one call, instead of a page fault per 4 KiB page on first write: for
    a 38.5 MB slot another process wrote, 3-4 ms instead of 14-18 ms; for fresh pages, 23-29
    instead of 30-36. The main process only reads slots (if the consumer touches the batch at
    all) and maps lazily: populating there stalled the consumer while the slot pool grew.
    """
    return map_memfd(fd, nbytes, populate=populate)
