"""The modelled machine: its devices, each thread's current device and streams, the streams'
device memory through torch's caching allocator, page-locked host memory, the contexts made
and the count of host waits (see the package's notes). It knows pointers, not tensors: what
torch does with it is in :mod:`cuda_model.tensors`."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from cuda_model.allocator import Block, CachingAllocator, DeviceMemory
from cuda_model.driver import FakeLibcuda, FakeRuntime
from cuda_model.streams import Kernel, Mark, Stream, StreamContext, Wait, reached

DEVICE = torch.device("cuda", 0)
# torch.cuda.Stream() makes no stream: it hands out the next of a pool of this many, per
# device and priority, round-robin (c10/cuda/CUDAStream.cpp's kStreamsPerPool).
POOL_SIZE = 32


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


class Gpu:
    """A machine of ``devices`` modelled GPUs of ``memory_bytes`` each (see the package's
    notes)."""

    def __init__(self, memory_bytes: int = 64 << 20, devices: int = 1) -> None:
        self.count, self.capacity = devices, memory_bytes
        self._np = np.zeros(memory_bytes * devices, np.uint8)  # untouched pages cost nothing
        self.memory = torch.from_numpy(self._np)
        self.base = self.memory.data_ptr()
        self.lock = threading.RLock()  # the copy may run in a helper thread
        self.streams: list[Stream] = []
        self.contexts: set[int] = set()  # the devices whose primary context exists
        self.defaults = [Stream(self, "default" if i == 0 else f"default{i}", i)
                         for i in range(devices)]
        self.default = self.defaults[0]
        self.capturing: set[Stream] = set()  # streams a CUDA graph is being captured on
        self.allocators = [CachingAllocator(DeviceMemory(i, i * memory_bytes, memory_bytes),
                                            wait=self._host_waits_for,
                                            capturing=lambda: bool(self.capturing))
                           for i in range(devices)]
        self._blocks: dict[int, Block] = {}  # offset -> live block
        self._freed: deque[Block] = deque()  # by finalizers, in any thread: handled at malloc
        self._stream_pools: dict[tuple[int, bool], list[Stream]] = {}
        self._handed: dict[tuple[int, bool], int] = {}
        self._local = threading.local()
        self.syncs: list[tuple[str, str]] = []  # (what, thread name)
        self.registered: dict[int, int] = {}  # cudaHostRegister: address -> bytes
        self.pool: dict[int, int] = {}  # torch's pinned pool: address -> bytes, while alive
        self.staged = 0  # host copies into the pinned pool
        self.runtime = FakeRuntime(self)
        self.driver = FakeLibcuda(self)

    # -- devices and each thread's current one ---------------------------------------------------
    def index(self, device: object = None) -> int:
        """The device index ``device`` means (None, or a bare "cuda": the current device)."""
        if device is None:
            return self.current_device()
        if isinstance(device, int):
            index = device
        else:
            index = torch.device(device).index
            index = self.current_device() if index is None else index
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal ({index}; the model has "
                               f"{self.count})")
        return index

    def touch(self, index: int) -> None:
        """Anything done on device ``index`` (a launch, an allocation, an event) needs its
        primary context: made now if there is none."""
        self.contexts.add(index)

    def current_device(self) -> int:
        """This thread's current device: a new thread starts on device 0, as in CUDA."""
        return getattr(self._local, "device", 0)

    def set_device(self, device: object) -> None:
        """``torch.cuda.set_device``: cudaSetDevice, which on CUDA 12 makes the device's primary
        context, even where the device is current already (a new thread's 0: torch's own test
        of primary contexts expects ``set_device(0)`` to make device 0's)."""
        index = self.index(device)
        self.touch(index)
        self._local.device = index

    def exchange_device(self, device: object) -> None:
        """What torch's guards and ``set_stream`` do (``ExchangeDevice``): cudaSetDevice only
        where the device is not current already."""
        index = self.index(device)
        if index != self.current_device():
            self.set_device(index)

    @contextlib.contextmanager
    def device_guard(self, device: object):
        """``torch.cuda.device(d)``: the device made current (``_exchange_device``); the
        previous one restored on leaving without making its context (``_maybe_exchange_device``:
        torch only records it when it has none)."""
        if device is None or (isinstance(device, int) and device < 0):
            yield
            return
        previous = self.current_device()
        self.exchange_device(device)
        try:
            yield
        finally:
            self._local.device = previous

    # -- streams ---------------------------------------------------------------------------------
    def current_stream(self, device: object = None) -> Stream:
        index = self.index(device)
        return getattr(self._local, "streams", {}).get(index, self.defaults[index])

    def set_stream(self, stream: Stream) -> None:
        """``torch.cuda.set_stream`` (Module.cpp's setStream): the stream's device is made
        current first when it is not (cudaSetDevice)."""
        if self.current_device() != stream.device_index:
            self.exchange_device(stream.device_index)
        if not hasattr(self._local, "streams"):
            self._local.streams = {}
        self._local.streams[stream.device_index] = stream

    def stream(self, stream: Stream | None) -> StreamContext:
        return StreamContext(self, stream)

    def default_stream(self, device: object = None) -> Stream:
        return self.defaults[self.index(device)]

    def pool_stream(self, device: object = None, priority: int = 0) -> Stream:
        """``torch.cuda.Stream()``: the next stream of torch's pool for the device and the
        priority (low, or high when negative), round-robin, so that the 33rd is the first
        again. torchvision's decoder and NCCL take theirs from the same pool."""
        index = self.index(device)
        self.touch(index)
        key = (index, priority < 0)
        pool = self._stream_pools.setdefault(key, [])
        handed = self._handed.get(key, 0)
        self._handed[key] = handed + 1
        if handed < POOL_SIZE:
            name = f"{'high' if key[1] else 'pool'}{handed}" + (f"@{index}" if index else "")
            pool.append(Stream(self, name, index))
        return pool[handed % POOL_SIZE]

    def external_stream(self, handle: int, device: object = None) -> Stream:
        """``torch.cuda.ExternalStream``: the stream a handle of :attr:`driver` names."""
        return self.driver.stream(handle)

    @contextlib.contextmanager
    def capture(self, stream: Stream):
        """``torch.cuda.graph`` on ``stream``: a CUDA graph captured there until the block
        ends (the allocator knows, whatever the thread; torch's Python asks only about the
        current stream: :meth:`is_current_stream_capturing`)."""
        self.capturing.add(stream)
        try:
            with self.stream(stream):
                yield
        finally:
            self.capturing.discard(stream)

    def is_current_stream_capturing(self) -> bool:
        return self.current_stream() in self.capturing

    def launch(self, stream: Stream, name: str, run: object) -> None:
        with self.lock:
            self.touch(stream.device_index)
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
            reached(item)
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

    def _host_waits_for(self, mark: Mark) -> None:
        self.sync("the caching allocator waits for a stream's use of a freed block")
        self.advance(mark.stream, lambda: mark.done)

    # -- device memory ---------------------------------------------------------------------------
    def release(self, block: Block) -> None:
        # A finalizer, in whatever thread drops the last tensor, at any point (inside an
        # allocation too): like torch's allocator, it records an event on each stream that
        # used the block, now; the pools change at the next allocation.
        block.freed_at = [stream.mark() for stream in block.uses]
        self._freed.append(block)

    def _collect(self) -> None:
        while self._freed:
            block = self._freed.popleft()
            self._blocks.pop(block.offset, None)
            self.allocators[self.device_of_offset(block.offset)].free(block, block.freed_at)

    def device_of_offset(self, offset: int) -> int:
        return offset // self.capacity

    def allocate(self, nbytes: int, stream: Stream) -> Block:
        with self.lock:
            self.touch(stream.device_index)
            self._collect()
            block = self.allocators[stream.device_index].malloc(nbytes, stream)
            self._blocks[block.offset] = block
            return block

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: every device's cached, unused segments released."""
        with self.lock:
            self._collect()
            for allocator in self.allocators:
                allocator.empty_cache()

    def allocator(self, device: object = None) -> CachingAllocator:
        """The caching allocator of ``device`` (default: the current one), its figures
        current (what finalizers freed handed back)."""
        with self.lock:
            self._collect()
            return self.allocators[self.index(device)]

    def mem_get_info(self, device: object = None) -> tuple[int, int]:
        """``torch.cuda.mem_get_info``: the device's free and total bytes (cudaMemGetInfo)."""
        memory = self.allocator(device).memory
        return memory.capacity - sum(memory.taken.values()), memory.capacity

    @property
    def reserved(self) -> int:
        """The bytes torch's allocator holds on device 0, in use or cached."""
        return self.allocators[0].reserved

    def block_memory(self, block: Block) -> np.ndarray:
        return self._np[block.offset : block.offset + block.nbytes]

    def holds(self, address: int) -> bool:
        return self.base <= address <= self.base + self._np.size

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        # the storage's address: an empty tensor's own is 0
        address = _plain(tensor).untyped_storage().data_ptr()
        return torch.device("cuda", self.device_of_offset(address - self.base))

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

    def host_value(self, what: str, compute, device: object = None):
        """Something the host needs device values for: a copy to the host on the current stream
        (of the values' device) waits for that stream's work, then the values are read."""
        self.sync(what)
        stream = self.current_stream(device)
        self.advance(stream, stream.query)
        with torch._C.DisableTorchFunction():
            return compute()
