"""The modelled device: streams, events, memory and its caching allocator, page-locked host
memory and the count of host waits (see the package's notes). It knows pointers, not tensors:
what torch does with it is in :mod:`cuda_model.tensors`."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

DEVICE = torch.device("cuda", 0)
_ALIGN = 512
# torch.cuda.Stream() makes no stream: it hands out the next of a pool of this many, per
# priority, round-robin (c10/cuda/CUDAStream.cpp's kStreamsPerPool).
POOL_SIZE = 32


# -- streams and events ------------------------------------------------------------------------

@dataclass(eq=False)
class Mark:
    """A point of a stream's queue; ``done`` once the device got there."""

    stream: Stream
    done: bool = False


@dataclass
class Wait:
    mark: Mark


@dataclass
class Kernel:
    name: str
    run: object


class Stream:
    def __init__(self, gpu: Gpu, name: str) -> None:
        self.gpu, self.name = gpu, name
        self.queue: deque = deque()
        self.device = DEVICE
        gpu.streams.append(self)

    def __repr__(self) -> str:
        return f"<stream {self.name}>"

    def mark(self) -> Mark:
        mark = Mark(self)
        self.queue.append(mark)
        return mark

    def wait_event(self, event: Event) -> None:
        if event.recorded is not None:
            self.queue.append(Wait(event.recorded))

    def wait_stream(self, other: Stream) -> None:
        self.queue.append(Wait(other.mark()))

    def query(self) -> bool:
        return not self.queue

    def synchronize(self) -> None:
        self.gpu.sync(f"{self.name}.synchronize()")
        self.gpu.advance(self, self.query)


class Event:
    def __init__(self, gpu: Gpu) -> None:
        self.gpu = gpu
        self.recorded: Mark | None = None

    def record(self, stream: Stream | None = None) -> None:
        self.recorded = (stream or self.gpu.current_stream()).mark()

    def query(self) -> bool:
        return self.recorded is None or self.recorded.done

    def synchronize(self) -> None:
        self.gpu.sync("Event.synchronize()")
        if self.recorded is not None:
            self.gpu.advance(self.recorded.stream, self.query)


class _StreamContext:
    def __init__(self, gpu: Gpu, stream: Stream | None) -> None:
        self.gpu, self.stream = gpu, stream

    def __enter__(self) -> None:
        self.previous = self.gpu.current_stream()
        if self.stream is not None:
            self.gpu._local.stream = self.stream

    def __exit__(self, *exc: object) -> None:
        self.gpu._local.stream = self.previous


# -- memory --------------------------------------------------------------------------------------

@dataclass(eq=False)
class Block:
    offset: int
    nbytes: int
    stream: Stream
    uses: set = field(default_factory=set)  # streams named by record_stream


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor)


def _layout(shape, dtype, stride=None) -> tuple[tuple, tuple, int, int]:
    """``(shape, strides, itemsize, bytes spanned)`` of a new tensor (contiguous by default)."""
    shape = tuple(shape)
    stride = tuple(torch.empty(shape, device="meta").stride() if stride is None else stride)
    itemsize = torch.empty((), dtype=dtype).element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else 0
    return shape, stride, itemsize, span * itemsize


def _within(ranges: dict[int, int], address: int) -> bool:
    return any(start <= address < start + n for start, n in ranges.items())


@dataclass(frozen=True)
class _Pointer:
    """A device tensor as a kernel holds it: an address, not a reference (a block it reads can
    be freed, and handed out again, while the kernel is still queued)."""

    address: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype


class FakeRuntime:
    """The page-locking CUDA runtime (fastfeed.slots.page_lock.CudaRuntime): registration marks
    a range page-locked; ``refuse=True`` fails every registration."""

    def __init__(self, gpu: Gpu, refuse: bool = False) -> None:
        self.gpu, self.refuse = gpu, refuse
        self.created: list[Stream] = []  # cudaStreamCreateWithFlags, in order

    def stream_create(self, index: int) -> int:
        """A new stream of its own (not torch's pool), as a handle for ``ExternalStream``."""
        stream = Stream(self.gpu, f"created{len(self.created)}")
        self.created.append(stream)
        return id(stream)

    def device(self, index: int):
        return contextlib.nullcontext()

    def host_register(self, address: int, nbytes: int) -> int:
        if self.refuse:
            return 1  # cudaErrorInvalidValue
        self.gpu.registered[address] = nbytes
        return 0

    def host_unregister(self, address: int) -> None:
        self.gpu.registered.pop(address, None)

    def clear_error(self, error: int) -> bool:
        return True


class Gpu:
    """One modelled device (see the package's notes)."""

    def __init__(self, memory_bytes: int = 64 << 20) -> None:
        self._np = np.zeros(memory_bytes, np.uint8)
        self.memory = torch.from_numpy(self._np)
        self.base = self.memory.data_ptr()
        self._top = 0
        self._blocks: dict[int, Block] = {}  # offset -> live block
        self._pools: dict[Stream, list[Block]] = {}
        # Freed blocks, each with the points its other streams must pass before it is reused.
        self._freed: deque[tuple[Block, list[Mark]]] = deque()
        self._pending: list[tuple[Block, list[Mark]]] = []
        self.streams: list[Stream] = []
        self.default = Stream(self, "default")
        self._stream_pools: dict[bool, list[Stream]] = {}  # torch's, by high priority
        self._handed: dict[bool, int] = {}
        self._local = threading.local()
        self.syncs: list[tuple[str, str]] = []  # (what, thread name)
        self.registered: dict[int, int] = {}  # cudaHostRegister: address -> bytes
        self.pool: dict[int, int] = {}  # torch's pinned pool: address -> bytes, while alive
        self.staged = 0  # host copies into the pinned pool
        self.runtime = FakeRuntime(self)
        self.lock = threading.RLock()  # the copy may run in a helper thread

    # -- streams -----------------------------------------------------------------------------
    def current_stream(self, device: object = None) -> Stream:
        return getattr(self._local, "stream", self.default)

    def stream(self, stream: Stream | None) -> _StreamContext:
        return _StreamContext(self, stream)

    def pool_stream(self, device: object = None, priority: int = 0) -> Stream:
        """``torch.cuda.Stream()``: the next stream of torch's pool for the priority (low, or
        high when negative), round-robin, so that the 33rd is the first again."""
        high = priority < 0
        pool = self._stream_pools.setdefault(high, [])
        handed = self._handed.get(high, 0)
        self._handed[high] = handed + 1
        if handed < POOL_SIZE:
            pool.append(Stream(self, f"{'high' if high else 'pool'}{handed}"))
        return pool[handed % POOL_SIZE]

    def external_stream(self, handle: int, device: object = None) -> Stream:
        """``torch.cuda.ExternalStream``: the stream a handle of :attr:`runtime` names."""
        return next(s for s in self.runtime.created if id(s) == handle)

    def launch(self, stream: Stream, name: str, run: object) -> None:
        with self.lock:
            stream.queue.append(Kernel(name, run))

    def write(self, stream: Stream, tensor: torch.Tensor, values: torch.Tensor) -> None:
        """Queue on ``stream`` a kernel that writes ``values`` into ``tensor`` (as a library's
        own kernels do, behind torch's back)."""
        pointer = self.pointer(tensor)
        self.launch(stream, "write", lambda: self.at(pointer).copy_(values))

    def sync(self, what: str) -> None:
        self.syncs.append((what, threading.current_thread().name))

    def syncs_in(self, thread: str = "MainThread") -> list[str]:
        return [what for what, name in self.syncs if name == thread]

    def synchronize(self, device: object = None) -> None:
        self.sync("torch.cuda.synchronize()")
        self.run()

    def _step(self, stream: Stream) -> bool:
        item = stream.queue[0]
        if isinstance(item, Wait) and not item.mark.done:
            return False
        stream.queue.popleft()
        if isinstance(item, Mark):
            item.done = True
        elif isinstance(item, Kernel):
            with torch._C.DisableTorchFunction():
                item.run()
        return True

    def run(self, *first: Stream) -> None:
        """Run everything queued: the streams in ``first`` as far as each can, in that order,
        before any other gets a turn (the adversary's schedule)."""
        with self.lock:
            order = [*first, *(s for s in self.streams if s not in first)]
            while any(stream.queue and self._step(stream) for stream in order):
                pass
            if any(s.queue for s in self.streams):
                raise AssertionError("the device is deadlocked: every stream waits")

    def advance(self, stream: Stream, done) -> None:
        """What a host wait lets run: ``stream`` until ``done()``, and of the other streams only
        the work it waits for (the adversary lets nothing else move)."""
        with self.lock:
            while not done() and stream.queue:
                item = stream.queue[0]
                if isinstance(item, Wait) and not item.mark.done:
                    self.advance(item.mark.stream, lambda mark=item.mark: mark.done)
                self._step(stream)

    # -- the caching allocator ---------------------------------------------------------------
    def release(self, block: Block) -> None:
        # A finalizer, in whatever thread drops the last tensor: like torch's allocator, it
        # records an event on each stream that used the block, now; the pools change later.
        self._freed.append((block, [stream.mark() for stream in block.uses]))

    def _collect(self) -> None:
        while self._freed:
            self._pending.append(self._freed.popleft())
        still = []
        for block, marks in self._pending:
            if all(m.done for m in marks):
                self._pools.setdefault(block.stream, []).append(block)
            else:
                still.append((block, marks))
        self._pending = still

    @property
    def reserved(self) -> int:
        """The bytes the allocator holds, in use or cached: the most it ever needed at once."""
        return self._top

    def allocate(self, nbytes: int, stream: Stream) -> Block:
        with self.lock:
            return self._allocate(nbytes, stream)

    def _allocate(self, nbytes: int, stream: Stream) -> Block:
        self._collect()
        size = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        pool = self._pools.setdefault(stream, [])
        fits = [b for b in reversed(pool) if b.nbytes >= size]  # the latest freed first
        if fits:
            block = min(fits, key=lambda b: b.nbytes)
            pool.remove(block)
            block.uses = set()
        else:
            if self._top + size > self._np.size:
                raise MemoryError("the modelled device is out of memory")
            block = Block(self._top, size, stream)
            self._top += size
        self._blocks[block.offset] = block
        return block

    def block_memory(self, block: Block) -> np.ndarray:
        return self._np[block.offset : block.offset + block.nbytes]

    def holds(self, address: int) -> bool:
        return self.base <= address <= self.base + self._np.size

    def block_of(self, tensor: torch.Tensor) -> Block:
        offset = _plain(tensor).data_ptr() - self.base
        for start, block in self._blocks.items():
            if start <= offset < start + block.nbytes:
                return block
        raise AssertionError("not a device tensor of this model")

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        block = self.block_of(tensor)
        if stream is not block.stream:
            block.uses.add(stream)

    def pointer(self, tensor: torch.Tensor) -> _Pointer:
        plain = _plain(tensor)
        return _Pointer(plain.data_ptr(), tuple(plain.shape), tuple(plain.stride()), plain.dtype)

    def at(self, pointer: _Pointer) -> torch.Tensor:
        """The memory a pointer names, now."""
        itemsize = torch.empty((), dtype=pointer.dtype).element_size()
        typed = self.memory[: self.memory.numel() - self.memory.numel() % itemsize]
        return torch.as_strided(typed.view(pointer.dtype), pointer.shape, pointer.stride,
                                (pointer.address - self.base) // itemsize)

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor's bytes now, as the test sees them (no sync: run the device first)."""
        return _plain(tensor).clone()

    # -- page-locked host memory -------------------------------------------------------------
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        address = tensor.data_ptr()
        return _within(self.registered, address) or _within(self.pool, address)

    def pinned_empty(self, shape, dtype, stride=None) -> torch.Tensor:
        """A tensor of torch's pinned pool."""
        shape, stride, _, nbytes = _layout(shape, dtype, stride)
        buffer = np.zeros(max(nbytes, 1), np.uint8)
        self.pool[buffer.ctypes.data] = buffer.nbytes
        weakref.finalize(buffer, self.pool.pop, buffer.ctypes.data, None)
        self.staged += 1
        with torch._C.DisableTorchFunction():
            typed = torch.from_numpy(buffer)[:nbytes].view(dtype)
            return torch.as_strided(typed, shape, stride)

    def host_value(self, what: str, compute):
        """Something the host needs device values for: a copy to the host on the current stream
        waits for that stream's work, then the values are read."""
        self.sync(what)
        stream = self.current_stream()
        self.advance(stream, stream.query)
        with torch._C.DisableTorchFunction():
            return compute()
