"""Encoded sequences written once into one anonymous file (a ``memfd``), sealed so that no
process can change it, and mapped read-only: by the main process, whose forked workers inherit
the mapping, and by a spawned worker from the descriptor it is handed."""

from __future__ import annotations

import fcntl
import mmap
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fastfeed.shared_lists.columns import EncodedSequence, Layout, Part, SequenceLayout
from fastfeed.shared_lists.shared_list import SharedList
from fastfeed.slots.memory import map_memfd, round_up

__all__ = ["PackedLists"]

_ALIGN = 64  # every array starts on a cache line
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


@dataclass(frozen=True)
class Placement:
    """Where each sequence's arrays go, and the bytes to write there."""

    layouts: tuple[SequenceLayout, ...]
    writes: tuple[tuple[int, memoryview], ...]
    nbytes: int


def place(sequences: Sequence[EncodedSequence]) -> Placement:
    """Lay ``sequences`` out end to end, each array aligned."""
    writes: list[tuple[int, memoryview]] = []
    end = 0

    def put(array: np.ndarray | bytes | None) -> Part | None:
        nonlocal end
        if array is None:
            return None
        data = (array.data if isinstance(array, np.ndarray) else memoryview(array)).cast("B")
        part = Part(round_up(end, _ALIGN), data.nbytes)
        writes.append((part.offset, data))
        end = part.offset + part.nbytes
        return part

    layouts = tuple(
        Layout(sequence.length, sequence.arity, sequence.container,
               tuple(column.placed(put) for column in sequence.columns))
        for sequence in sequences)
    # A mapping is at least a page (a sequence of Nones needs no byte at all).
    return Placement(layouts, tuple(writes), round_up(max(end, 1), mmap.PAGESIZE))


class PackedLists:
    """Sequences in one sealed ``memfd``, mapped read-only.

    Attributes:
        lists: one :class:`SharedList` per sequence packed.
        layouts: where each is, for a process that maps the same file.
        nbytes: the file's size.
        fd: the file's descriptor, for handing to a process that starts later (None once
            :meth:`close_fd` was called, or in a process that attached).
    """

    def __init__(self, fd: int | None, nbytes: int, layouts: tuple[SequenceLayout, ...],
                 mapped_from: int) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self.layouts = layouts
        # Populated: every page is mapped here too, so a worker's pages of it count as shared
        # with this process, as they are, not as its private memory.
        memory = map_memfd(mapped_from, nbytes, writable=False, populate=True).toreadonly()
        self.lists = [SharedList(memory, layout) for layout in layouts]
        self._closer = None if fd is None else weakref.finalize(self, os.close, fd)

    @classmethod
    def pack(cls, sequences: Sequence[EncodedSequence]) -> PackedLists:
        """Write ``sequences`` into a new sealed file and map it."""
        placement = place(sequences)
        fd = os.memfd_create("fastfeed-lists", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, placement.nbytes)
            for offset, data in placement.writes:
                _write_all(fd, data, offset)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            return cls(fd, placement.nbytes, placement.layouts, mapped_from=fd)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, nbytes: int, layouts: tuple[SequenceLayout, ...]) -> PackedLists:
        """Map the file another process packed, from ``fd`` (not kept: the caller closes it)."""
        return cls(None, nbytes, layouts, mapped_from=fd)

    def close_fd(self) -> None:
        """Close the descriptor (the mapping stays): no process will be handed it any more."""
        if self._closer is not None:
            self._closer()
        self.fd = None


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written
