"""torch's CUDA caching allocator for one modelled device, with the rules of
``c10/cuda/CUDACachingAllocator.cpp`` that decide how much memory a workload holds:

- a request is rounded up to 512 bytes; one of 1 MiB or less comes from the small pool, whose
  segments (``cudaMalloc`` calls) are 2 MiB; a larger one from the large pool, whose segments
  are 20 MiB below 10 MiB and the request rounded up to 2 MiB from there;
- a free block of a segment is split for a smaller request (the rest kept if it is at least
  512 bytes in the small pool, over 1 MiB in the large one), and merged back with its free
  neighbours when freed;
- free blocks are cached per stream: a block goes back to the pool of the stream it was
  allocated on and only that stream's allocations take it, at once; a block ``record_stream``
  named other streams for waits until each has passed the point it was at when it was freed;
- when ``cudaMalloc`` fails the allocator waits for those streams (a host sync), releases every
  cached segment with nothing allocated in it (``empty_cache``) and tries once more; then it
  raises ``torch.OutOfMemoryError``. While a CUDA graph is captured (on any thread) it skips
  that release, and ``empty_cache`` fails its internal assert, before it waits or frees.

The device's memory is shared with libraries that call ``cudaMalloc`` themselves (nvJPEG):
:meth:`DeviceMemory.driver_malloc`. Addresses are offsets into the modelled memory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class Segment:
    offset: int
    nbytes: int
    stream: object
    small: bool
    blocks: list[Block] = field(default_factory=list)  # in address order, covering it


@dataclass(eq=False)
class Block:
    offset: int
    nbytes: int
    segment: Segment
    allocated: bool = False
    uses: set = field(default_factory=set)  # streams named by record_stream
    freed_at: list = field(default_factory=list)  # their points when it was freed

    @property
    def stream(self) -> object:
        return self.segment.stream


class DeviceMemory:
    """The memory of one device, ``[start, start + capacity)``: segments of the caching
    allocator and the libraries' own allocations, first fit."""

    def __init__(self, index: int, start: int, capacity: int) -> None:
        self.index, self.start, self.capacity = index, start, capacity
        self.taken: dict[int, int] = {}  # offset -> bytes
        self.library = 0  # bytes libraries hold (driver_malloc)

    def malloc(self, nbytes: int) -> int | None:
        """``cudaMalloc``: an offset (512-byte aligned, as CUDA's are), or None when no gap is
        large enough."""
        nbytes = round_size(nbytes)
        at = self.start
        for offset in sorted(self.taken):
            if offset - at >= nbytes:
                break
            at = max(at, offset + self.taken[offset])
        if at + nbytes > self.start + self.capacity:
            return None
        self.taken[at] = nbytes
        return at

    def free(self, offset: int) -> None:
        del self.taken[offset]

    def driver_malloc(self, nbytes: int) -> int | None:
        """A library's own ``cudaMalloc`` (outside torch's cache); None if it fails."""
        offset = self.malloc(nbytes)
        if offset is not None:
            self.library += self.taken[offset]
        return offset

    def driver_free(self, offset: int) -> None:
        self.library -= self.taken[offset]
        self.free(offset)


def _out_of_memory(index: int, size: int, memory: DeviceMemory, reserved: int,
                   allocated: int) -> torch.OutOfMemoryError:
    mib = 1 << 20
    free = memory.capacity - sum(memory.taken.values())
    return torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {size / mib:.2f} MiB. GPU {index} has a total "
        f"capacity of {memory.capacity / mib:.2f} MiB of which {free / mib:.2f} MiB is free. "
        f"Of the allocated memory {allocated / mib:.2f} MiB is allocated by PyTorch, and "
        f"{(reserved - allocated) / mib:.2f} MiB is reserved by PyTorch but unallocated.")


class CachingAllocator:
    """torch's caching allocator on one device (see the module's notes).

    Args:
        memory: the device's memory.
        wait: makes the host wait until a point of a stream is done (a sync).
    """

    def __init__(self, memory: DeviceMemory, wait: Callable[[object], None],
                 capturing: Callable[[], bool] = lambda: False) -> None:
        self.memory, self._wait, self._capturing = memory, wait, capturing
        self.segments: list[Segment] = []
        self._pending: list[tuple[Block, list]] = []  # freed, waiting for other streams
        self.allocated = self.peak_allocated = self.peak_reserved = 0
        self.flushes = 0  # the out-of-memory flushes (and empty_cache calls)

    @property
    def reserved(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def reset_peak(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    # -- allocation ---------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: object) -> Block:
        self._process_events()
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._free_block(size, stream, small)
        if block is None:
            segment = self._new_segment(size, stream, small)
            if segment is None and not self._capturing():
                self.empty_cache()
                segment = self._new_segment(size, stream, small)
            if segment is None:
                raise _out_of_memory(self.memory.index, size, self.memory, self.reserved,
                                     self.allocated)
            block = segment.blocks[0]
        self._split(block, size)
        block.allocated, block.uses = True, set()
        self.allocated += block.nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def _free_block(self, size: int, stream: object, small: bool) -> Block | None:
        fits = [b for s in self.segments if s.stream is stream and s.small == small
                for b in s.blocks if not b.allocated and b.nbytes >= size
                and not any(b is p for p, _ in self._pending)]
        return min(fits, key=lambda b: (b.nbytes, b.offset), default=None)

    def _new_segment(self, size: int, stream: object, small: bool) -> Segment | None:
        nbytes = segment_size(size)
        offset = self.memory.malloc(nbytes)
        if offset is None:
            return None
        segment = Segment(offset, nbytes, stream, small)
        segment.blocks.append(Block(offset, nbytes, segment))
        self.segments.append(segment)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return segment

    def _split(self, block: Block, size: int) -> None:
        rest = block.nbytes - size
        if rest >= MIN_BLOCK if block.segment.small else rest > SMALL_SIZE:
            blocks = block.segment.blocks
            blocks.insert(blocks.index(block) + 1, Block(block.offset + size, rest,
                                                         block.segment))
            block.nbytes = size

    # -- freeing ------------------------------------------------------------------------------
    def free(self, block: Block, marks: list) -> None:
        """A block's last tensor is gone: back to its stream's pool, or, if other streams used
        it, once they have passed ``marks``, their points when it was freed."""
        self.allocated -= block.nbytes
        block.allocated = False
        if marks:
            self._pending.append((block, marks))
        else:
            self._merge(block)

    def _merge(self, block: Block) -> None:
        blocks = block.segment.blocks
        if not any(b is block for b in blocks):
            return  # merged into a neighbour freed in the same round
        i = blocks.index(block)
        for j in (i + 1, i - 1):  # the next first, so that i stays valid for the previous
            if 0 <= j < len(blocks) and self._mergeable(blocks[j]):
                low, high = sorted((blocks[i], blocks[j]), key=lambda b: b.offset)
                low.nbytes += high.nbytes
                blocks.remove(high)
                i = blocks.index(low)

    def _mergeable(self, block: Block) -> bool:
        return not block.allocated and not any(block is p for p, _ in self._pending)

    def _process_events(self) -> None:
        ready = [(b, m) for b, m in self._pending if all(mark.done for mark in m)]
        self._pending = [(b, m) for b, m in self._pending if not all(mark.done for mark in m)]
        for block, _ in ready:
            self._merge(block)

    def empty_cache(self) -> None:
        """Wait for the streams freed blocks wait for, then release every segment with nothing
        allocated in it (``torch.cuda.empty_cache()``, and the out-of-memory flush)."""
        if self._capturing():  # synchronize_and_free_events' first check
            raise RuntimeError("captures_underway.empty() INTERNAL ASSERT FAILED at "
                               "\"../c10/cuda/CUDACachingAllocator.cpp\":1715, please report a "
                               "bug to PyTorch.")
        self.flushes += 1
        for _, marks in self._pending:
            for mark in marks:
                self._wait(mark)
        self._process_events()
        for segment in [s for s in self.segments if not any(b.allocated for b in s.blocks)]:
            self.segments.remove(segment)
            self.memory.free(segment.offset)
