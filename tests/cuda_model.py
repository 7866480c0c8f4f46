"""A CUDA device modelled on the CPU, with the semantics the GPU rules are about.

It is not a recorder of calls: code that breaks a rule gets wrong bytes, or a counted sync.

- **Streams** are queues. Queued work runs only when the test lets the device run
  (:meth:`Gpu.run`, streams in the order the test picks: the adversary) or when the host waits
  for it (a sync). An **event** marks a point of a stream; ``query()`` says whether the device
  got there; ``wait_event``/``wait_stream`` hold a stream at a point of another.
- **The copy engine.** ``tensor.to("cuda", non_blocking=True)`` from page-locked, dense memory
  queues a read of the source *by address*, done when its stream runs: a slot rewritten before
  then is copied with the new bytes. Anything else (pageable or non-dense memory, a blocking
  copy) is copied at once after the host waits for the stream: a sync.
- **Kernels.** An op on device tensors is queued on the current stream and computes when it
  runs, reading its inputs' memory then (views and metadata are immediate). An op that needs
  device values on the host (``.item()``, ``bool()``, ``.tolist()``, ``.cpu()``, a shape that
  depends on values: whatever cannot run on torch's ``meta`` device) makes the host wait for
  the device: a sync.
- **The caching allocator** is stream-ordered: a freed block goes back to the pool of the
  stream it was allocated on and is handed to that stream's next allocation at once, unless
  ``record_stream`` named other streams; then only once each of them has passed the point it
  was at when the block was freed.
- **Page-locked memory**: ranges registered with ``cudaHostRegister`` (through
  :attr:`Gpu.runtime`, the ring's) and torch's pinned pool, whose blocks live until the copies
  that read them have run (as torch's events keep them).
- **The sync detector**: :attr:`Gpu.syncs` lists every host-device synchronisation with the
  thread that made it: ``Event``/``Stream``/device ``synchronize``, host reads of device values,
  and blocking host-to-device copies (``torch.as_tensor``/``torch.tensor`` of host data on the
  device, ``.to("cuda")`` from pageable or non-dense memory).

Install it with the ``gpu`` fixture of the tests that use it (:func:`install`).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("cuda", 0)
_ALIGN = 512
_gpu: Gpu | None = None  # the model installed for the running test


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

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event(self.gpu)
        event.record(self)
        return event

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

    def wait(self, stream: Stream | None = None) -> None:
        (stream or self.gpu.current_stream()).wait_event(self)

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


class DeviceTensor(torch.Tensor):
    """A tensor in the model's device memory; every torch op on it goes through the model."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        assert _gpu is not None, "a device tensor outlived its model"
        return _gpu.device_op(func, args, kwargs or {})


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor)


def _dense(tensor: torch.Tensor) -> bool:
    dims = sorted((st, sz) for sz, st in zip(tensor.shape, tensor.stride(), strict=True) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _meta(x: object) -> object:
    if isinstance(x, DeviceTensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _convert(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _HOST_TO(tensor, dtype)


_HOST_TO = torch.Tensor.to
_IN_PLACE = ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")


def _is_cuda(device: object) -> bool:
    return device is not None and torch.device(device).type == "cuda"


@dataclass(frozen=True)
class _Pointer:
    """A device tensor as a kernel holds it: an address, not a reference (a block it reads can
    be freed, and handed out again, while the kernel is still queued)."""

    address: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype


class FakeRuntime:
    """The ring's CUDA runtime (fastfeed.pinning.CudaRuntime): registration marks a range
    page-locked; ``refuse=True`` fails every registration."""

    def __init__(self, gpu: Gpu, refuse: bool = False) -> None:
        self.gpu, self.refuse = gpu, refuse

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
    """One modelled device. See the module's notes."""

    def __init__(self, memory_bytes: int = 64 << 20) -> None:
        self._np = np.zeros(memory_bytes, np.uint8)
        self.memory = torch.from_numpy(self._np)
        self.base = self.memory.data_ptr()
        self._top = 0
        self._blocks: dict[int, Block] = {}  # offset -> live block
        self._pools: dict[Stream, list[Block]] = {}
        self._freed: deque[Block] = deque()  # from finalizers, in any thread: applied later
        self._pending: list[tuple[Block, list[Mark]]] = []
        self.streams: list[Stream] = []
        self.default = Stream(self, "default")
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

    def new_stream(self, device: object = None, priority: int = 0) -> Stream:
        return Stream(self, f"side{len(self.streams)}")

    def launch(self, stream: Stream, name: str, run: object) -> None:
        with self.lock:
            stream.queue.append(Kernel(name, run))

    def write(self, stream: Stream, tensor: torch.Tensor, values: torch.Tensor) -> None:
        """Queue on ``stream`` a kernel that writes ``values`` into ``tensor`` (as a library's
        own kernels do, behind torch's back)."""
        pointer = self._pointer(tensor)
        self.launch(stream, "write", lambda: self._at(pointer).copy_(values))

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
    def _collect(self) -> None:
        while self._freed:
            block = self._freed.popleft()
            if block.uses:  # events on the streams that used it, recorded now
                self._pending.append((block, [s.mark() for s in block.uses]))
            else:
                self._pools.setdefault(block.stream, []).append(block)
        still = []
        for block, marks in self._pending:
            if all(m.done for m in marks):
                self._pools.setdefault(block.stream, []).append(block)
            else:
                still.append((block, marks))
        self._pending = still

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

    def empty(self, shape, dtype, stride=None, stream: Stream | None = None) -> DeviceTensor:
        """A device tensor over a new block, allocated on ``stream`` (the current one)."""
        shape = tuple(shape)
        if stride is None:
            stride = torch.empty(shape, device="meta").stride() if shape else ()
        itemsize = torch.empty((), dtype=dtype).element_size()
        span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) \
            else 0
        block = self.allocate(span * itemsize, stream or self.current_stream())
        holder = self._np[block.offset : block.offset + block.nbytes]
        # When the last tensor over the block dies, so does the holder, and the block is freed.
        weakref.finalize(holder, self._freed.append, block)
        with torch._C.DisableTorchFunction():
            raw = torch.frombuffer(holder, dtype=torch.uint8)
            typed = raw[: block.nbytes - block.nbytes % itemsize].view(dtype)
            tensor = torch.as_strided(typed, shape, tuple(stride))
        del holder
        return tensor.as_subclass(DeviceTensor)

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

    def _pointer(self, tensor: torch.Tensor) -> _Pointer:
        plain = _plain(tensor)
        return _Pointer(plain.data_ptr(), tuple(plain.shape), tuple(plain.stride()), plain.dtype)

    def _at(self, pointer: _Pointer) -> torch.Tensor:
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
        return any(start <= address < start + n
                   for ranges in (self.registered, self.pool) for start, n in ranges.items())

    def pinned_empty(self, shape, dtype, stride=None) -> torch.Tensor:
        """A tensor of torch's pinned pool."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if stride is None:
            stride = torch.empty(shape, device="meta").stride() if len(shape) else ()
        span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) \
            else 0
        buffer = np.zeros(max(span * itemsize, 1), np.uint8)
        self.pool[buffer.ctypes.data] = buffer.nbytes
        weakref.finalize(buffer, self.pool.pop, buffer.ctypes.data, None)
        with torch._C.DisableTorchFunction():
            typed = torch.from_numpy(buffer)[: span * itemsize].view(dtype)
            return torch.as_strided(typed, tuple(shape), tuple(stride))

    # -- copies ------------------------------------------------------------------------------
    def to_device(self, tensor: torch.Tensor, non_blocking: bool) -> DeviceTensor:
        """A host tensor copied to the device on the current stream."""
        stream = self.current_stream()
        if isinstance(tensor, DeviceTensor):
            return tensor
        if non_blocking and _dense(tensor) and self.is_pinned(tensor):
            out = self.empty(tensor.shape, tensor.dtype, tensor.stride())
            if tensor.numel():
                nbytes = tensor.numel() * tensor.element_size()
                source, dest = tensor.data_ptr(), self._pointer(out).address
                # torch's pool keeps its block until the copy has read it; a ring slot is
                # read by address only: nothing keeps it but its fence.
                keep = tensor.untyped_storage() if self.is_pooled(tensor) else None

                def dma(keep=keep):
                    ctypes.memmove(dest, source, nbytes)

                self.launch(stream, "copy host to device", dma)
            return out
        self.sync("a blocking host-to-device copy" if not non_blocking else
                  "a host-to-device copy from pageable or non-dense memory")
        self.advance(stream, stream.query)
        out = self.empty(tensor.shape, tensor.dtype)
        _plain(out).copy_(tensor)
        return out

    def is_pooled(self, tensor: torch.Tensor) -> bool:
        address = tensor.data_ptr()
        return any(start <= address < start + n for start, n in self.pool.items())

    def host_value(self, what: str, compute):
        """Something the host needs device values for: a copy to the host on the current stream
        waits for that stream's work, then the values are read."""
        self.sync(what)
        stream = self.current_stream()
        self.advance(stream, stream.query)
        with torch._C.DisableTorchFunction():
            return compute()

    # -- ops on device tensors ---------------------------------------------------------------
    def device_op(self, func, args, kwargs):
        name = getattr(func, "__name__", repr(func))
        special = _DEVICE_METHODS.get(func)
        if special is not None:
            return special(self, *args, **kwargs)
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DeviceTensor) \
                    and leaf.dim() > 0 and leaf.device.type == "cpu":
                raise RuntimeError("Expected all tensors to be on the same device, but found "
                                   f"at least two devices, cuda:0 and cpu! ({name})")
        plain_args, plain_kwargs = tree_map(
            lambda x: _plain(x) if isinstance(x, DeviceTensor) else x, (args, kwargs))
        try:
            with torch._C.DisableTorchFunction():
                meta_args, meta_kwargs = tree_map(_meta, (args, kwargs))
                result = func(*meta_args, **meta_kwargs)
        except Exception:  # it cannot run without the values: the host waits for them
            return self._on_device(self.host_value(
                f"{name} reads device values", lambda: func(*plain_args, **plain_kwargs)))
        pointers = tree_map(lambda x: self._pointer(x) if isinstance(x, DeviceTensor)
                            else x.clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))
        if (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE \
                or kwargs.get("out") is not None:
            def mutate():
                a, k = tree_map(lambda x: self._at(x) if isinstance(x, _Pointer) else x, pointers)
                func(*a, **k)

            self.launch(self.current_stream(), name, mutate)
            out = kwargs.get("out")
            return None if name == "__setitem__" else args[0] if out is None else out
        outputs = [x for x in tree_flatten(result)[0] if isinstance(x, torch.Tensor)]
        if not outputs:  # metadata: shape, dtype, strides, ...
            with torch._C.DisableTorchFunction():
                return func(*plain_args, **plain_kwargs)
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((meta_args, meta_kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        if all(t.untyped_storage()._cdata in inputs for t in outputs):
            with torch._C.DisableTorchFunction():  # a view: metadata only, done now
                return self._on_device(func(*plain_args, **plain_kwargs))
        made = tree_map(lambda t: self.empty(t.shape, t.dtype, t.stride())
                        if isinstance(t, torch.Tensor) else t, result)
        out_pointers = [self._pointer(t) for t in tree_flatten(made)[0]
                        if isinstance(t, torch.Tensor)]

        def compute():
            a, k = tree_map(lambda x: self._at(x) if isinstance(x, _Pointer) else x, pointers)
            values = [x for x in tree_flatten(func(*a, **k))[0] if isinstance(x, torch.Tensor)]
            for pointer, value in zip(out_pointers, values, strict=True):
                self._at(pointer).copy_(value)

        self.launch(self.current_stream(), name, compute)
        return made

    def _on_device(self, result):
        """Plain views of device memory back as device tensors, other tensors copied there."""
        def on_device(x):
            if not isinstance(x, torch.Tensor) or isinstance(x, DeviceTensor):
                return x
            if self.base <= x.data_ptr() <= self.base + self._np.size:
                return x.as_subclass(DeviceTensor)
            out = self.empty(x.shape, x.dtype)
            _plain(out).copy_(x)
            return out
        return tree_map(on_device, result)

    def factory(self, func, args, kwargs):
        """``torch.empty/zeros/full/arange/...(device="cuda")``: a block, filled by a kernel."""
        with torch._C.DisableTorchFunction():
            shape_of = func(*args, **{**kwargs, "device": "meta"})
        out = self.empty(shape_of.shape, shape_of.dtype, shape_of.stride())
        if not func.__name__.startswith("empty"):  # memory as the allocator left it
            pointer = self._pointer(out)
            self.launch(self.current_stream(), func.__name__, lambda: self._at(pointer).copy_(
                func(*args, **{**kwargs, "device": "cpu"})))
        return out

    def from_host_data(self, func, data, kwargs):
        """``torch.tensor/as_tensor(host data, device="cuda")``: a blocking copy."""
        with torch._C.DisableTorchFunction():
            host = func(data, **{**kwargs, "device": "cpu"})
        self.sync(f"torch.{func.__name__} of host data on the device (a blocking copy)")
        stream = self.current_stream()
        self.advance(stream, stream.query)
        out = self.empty(host.shape, host.dtype)
        _plain(out).copy_(host)
        return out


def _target(args, kwargs) -> tuple[torch.device | None, torch.dtype | None, bool]:
    """Where ``Tensor.to(*args, **kwargs)`` goes: ``(device, dtype, non_blocking)``."""
    if args and isinstance(args[0], torch.Tensor):  # .to(other): other's device and dtype
        other = args[0]
        device = DEVICE if isinstance(other, DeviceTensor) else _plain(other).device
        return device, _plain(other).dtype, bool(kwargs.get("non_blocking", False))
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype, non_blocking


def _device_to(gpu: Gpu, self, *args, **kwargs):
    device, dtype, _ = _target(args, kwargs)
    if device is not None and device.type == "cpu":
        return gpu.host_value("Tensor.to('cpu')", lambda: _plain(self).to(*args, **kwargs))
    if dtype is None or dtype == self.dtype:
        return self
    return gpu.device_op(_convert, (self, dtype), {})


def _pin_refused(gpu: Gpu, self, *args, **kwargs):
    raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned")


_DEVICE_METHODS = {
    torch.Tensor.to: _device_to,
    torch.Tensor.cuda: lambda gpu, self, *a, **k: self,
    torch.Tensor.is_pinned: lambda gpu, self, *a: False,
    torch.Tensor.pin_memory: _pin_refused,
    torch.Tensor.device.__get__: lambda gpu, self: DEVICE,
    torch.Tensor.is_cuda.__get__: lambda gpu, self: True,
    torch.Tensor.is_cpu.__get__: lambda gpu, self: False,
    torch.Tensor.__iter__: lambda gpu, self: iter(self.unbind(0)),
    torch.Tensor.__repr__: lambda gpu, self, *a, **k: f"DeviceTensor{tuple(self.shape)}",
}
for _method in (torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item):
    _DEVICE_METHODS[_method] = (lambda m: lambda gpu, self, *a, **k: gpu.host_value(
        f"Tensor.{m.__name__}()", lambda: m(_plain(self), *a, **k)))(_method)


# -- installing the model ----------------------------------------------------------------------

_FACTORIES = ("empty", "zeros", "ones", "full", "arange", "empty_strided", "rand", "randn",
              "zeros_like", "ones_like", "full_like", "empty_like")


def install(monkeypatch, gpu: Gpu) -> Gpu:
    """Make ``torch.cuda`` (and the tensor methods that reach it) the model, for one test."""
    monkeypatch.setattr(sys.modules[__name__], "_gpu", gpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", gpu.new_stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: Event(gpu))
    monkeypatch.setattr(torch.cuda, "stream", gpu.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", gpu.current_stream)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: gpu.default)
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)

    host_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if isinstance(self, DeviceTensor):
            return _device_to(gpu, self, *args, **kwargs)
        device, dtype, non_blocking = _target(args, kwargs)
        if device is not None and device.type == "cuda":
            moved = gpu.to_device(self, non_blocking)
            return moved if dtype is None else moved.to(dtype)
        return host_to(self, *args, **kwargs)

    def cuda(self, device=None, non_blocking=False):
        return to(self, DEVICE, non_blocking=non_blocking)

    def is_pinned(self, *args):
        return False if isinstance(self, DeviceTensor) else gpu.is_pinned(self)

    def pin_memory(self, *args):
        if isinstance(self, DeviceTensor):
            return _pin_refused(gpu, self)
        # torch's: the same strides over a block of the pool sized to span them
        pinned = gpu.pinned_empty(self.shape, self.dtype, self.stride())
        gpu.staged += 1
        with torch._C.DisableTorchFunction():
            pinned.copy_(self)
        return pinned

    def record_stream(self, stream):  # torch's parser refuses a stream it did not make
        if not isinstance(self, DeviceTensor):
            raise RuntimeError("record_stream of a tensor that is not on the device")
        gpu.record_stream(self, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "cuda", cuda)
    monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)

    for name in _FACTORIES:
        original = getattr(torch, name)

        def factory(*args, _original=original, **kwargs):
            like = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if kwargs.get("pin_memory"):
                kwargs.pop("pin_memory")
                if like is not None:
                    dense = _dense(like)
                    made = _original(*args, **{**kwargs, "device": "meta"})
                    stride = like.stride() if dense else made.stride()
                    pinned = gpu.pinned_empty(made.shape, made.dtype, stride)
                else:
                    made = _original(*args, **{**kwargs, "device": "meta"})
                    pinned = gpu.pinned_empty(made.shape, made.dtype)
                gpu.staged += 1
                return pinned
            if _is_cuda(kwargs.get("device")) or isinstance(like, DeviceTensor):
                if isinstance(like, DeviceTensor):
                    return gpu.device_op(_original, args, kwargs)
                return gpu.factory(_original, args, {**kwargs, "device": DEVICE})
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch, name, factory)

    for name in ("tensor", "as_tensor"):
        original = getattr(torch, name)

        def from_data(data, *args, _original=original, **kwargs):
            if not _is_cuda(kwargs.get("device")):
                return _original(data, *args, **kwargs)
            if isinstance(data, DeviceTensor):
                return data if _original is torch.as_tensor else gpu.device_op(
                    torch.Tensor.clone, (data,), {})
            return gpu.from_host_data(_original, data, kwargs)

        monkeypatch.setattr(torch, name, from_data)
    monkeypatch.setattr("fastfeed.pinning.TorchCudaRuntime", lambda: gpu.runtime)
    return gpu
