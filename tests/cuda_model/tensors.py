"""torch on the modelled device: device tensors whose every op goes through the model, copies to
it, and :func:`install`, which makes ``torch.cuda`` the model for one test."""

from __future__ import annotations

import ctypes
import os
import sys
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_map

from cuda_model.device import Gpu, _layout, _plain, _Pointer, _within
from cuda_model.streams import Event, Stream
from fastfeed.device import own_streams
from fastfeed.slots import page_lock

_gpu: Gpu | None = None  # the model installed for the running test
_HOST_TO = torch.Tensor.to
_IN_PLACE = ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")


class DeviceTensor(torch.Tensor):
    """A tensor in the model's device memory; every torch op on it goes through the model."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        assert _gpu is not None, "a device tensor outlived its model"
        return device_op(_gpu, func, args, kwargs or {})


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


def _is_cuda(device: object) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def empty(gpu: Gpu, shape, dtype, stride=None, stream: Stream | None = None,
          device: object = None) -> DeviceTensor:
    """A device tensor over a new block, allocated on ``stream`` (by default the current
    stream of ``device``, itself the current device by default)."""
    shape, stride, itemsize, nbytes = _layout(shape, dtype, stride)
    block = gpu.allocate(nbytes, stream or gpu.current_stream(device))
    holder = gpu.block_memory(block)
    # When the last tensor over the block dies, so does the holder, and the block is freed.
    weakref.finalize(holder, gpu.release, block)
    with torch._C.DisableTorchFunction():
        raw = torch.frombuffer(holder, dtype=torch.uint8)
        typed = raw[: block.nbytes - block.nbytes % itemsize].view(dtype)
        tensor = torch.as_strided(typed, shape, stride)
    del holder
    return tensor.as_subclass(DeviceTensor)


def to_device(gpu: Gpu, tensor: torch.Tensor, non_blocking: bool, device: object = None
              ) -> DeviceTensor:
    """A host tensor copied to ``device`` on its current stream."""
    stream = gpu.current_stream(device)
    if non_blocking and _dense(tensor) and gpu.is_pinned(tensor):
        out = empty(gpu, tensor.shape, tensor.dtype, tensor.stride(), stream)
        if tensor.numel():
            nbytes = tensor.numel() * tensor.element_size()
            source, dest = tensor.data_ptr(), gpu.pointer(out).address
            # torch's pool keeps its block until the copy has read it; a pool slot is read by
            # address only: nothing keeps it but its fence.
            held = tensor.untyped_storage() if _within(gpu.pool, source) else None

            def dma(held=held):
                ctypes.memmove(dest, source, nbytes)

            gpu.launch(stream, "copy host to device", dma)
        return out
    gpu.sync("a blocking host-to-device copy" if not non_blocking else
             "a host-to-device copy from pageable or non-dense memory")
    gpu.advance(stream, stream.query)
    out = empty(gpu, tensor.shape, tensor.dtype, stream=stream)
    _plain(out).copy_(tensor)
    return out


def _on_device(gpu: Gpu, result, stream: Stream):
    """Plain views of device memory back as device tensors, other tensors copied there."""
    def on_device(x):
        if not isinstance(x, torch.Tensor) or isinstance(x, DeviceTensor):
            return x
        if gpu.holds(x.data_ptr()):
            return x.as_subclass(DeviceTensor)
        out = empty(gpu, x.shape, x.dtype, stream=stream)
        _plain(out).copy_(x)
        return out
    return tree_map(on_device, result)


def device_op(gpu: Gpu, func, args, kwargs):
    """An op with device tensors among its arguments: metadata and views now, values queued
    as a kernel on the current stream, a host read of values as a sync."""
    name = getattr(func, "__name__", repr(func))
    special = _DEVICE_METHODS.get(func)
    if special is not None:
        return special(gpu, *args, **kwargs)
    leaves = tree_flatten((args, kwargs))[0]
    devices = {gpu.device_of(leaf) for leaf in leaves if isinstance(leaf, DeviceTensor)}
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DeviceTensor) \
                and leaf.dim() > 0 and leaf.device.type == "cpu":
            devices.add(torch.device("cpu"))
    if len(devices) > 1:
        raise RuntimeError("Expected all tensors to be on the same device, but found at "
                           f"least two devices, {', '.join(sorted(map(str, devices)))}! "
                           f"({name})")
    # torch's device guard: the op runs on its tensors' device's current stream
    stream = gpu.current_stream(next(iter(devices), None))
    plain_args, plain_kwargs = tree_map(
        lambda x: _plain(x) if isinstance(x, DeviceTensor) else x, (args, kwargs))
    try:
        with torch._C.DisableTorchFunction():
            meta_args, meta_kwargs = tree_map(_meta, (args, kwargs))
            result = func(*meta_args, **meta_kwargs)
    except Exception:  # it cannot run without the values: the host waits for them
        return _on_device(gpu, gpu.host_value(
            f"{name} reads device values", lambda: func(*plain_args, **plain_kwargs),
            stream.device_index), stream)
    pointers = tree_map(lambda x: gpu.pointer(x) if isinstance(x, DeviceTensor)
                        else x.clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))

    def at_pointers():
        return tree_map(lambda x: gpu.at(x) if isinstance(x, _Pointer) else x, pointers)

    if (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE \
            or kwargs.get("out") is not None:
        def mutate():
            a, k = at_pointers()
            func(*a, **k)

        gpu.launch(stream, name, mutate)
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
            return _on_device(gpu, func(*plain_args, **plain_kwargs), stream)
    made = tree_map(lambda t: empty(gpu, t.shape, t.dtype, t.stride(), stream)
                    if isinstance(t, torch.Tensor) else t, result)
    out_pointers = [gpu.pointer(t) for t in tree_flatten(made)[0] if isinstance(t, torch.Tensor)]

    def compute():
        a, k = at_pointers()
        values = [x for x in tree_flatten(func(*a, **k))[0] if isinstance(x, torch.Tensor)]
        for pointer, value in zip(out_pointers, values, strict=True):
            gpu.at(pointer).copy_(value)

    gpu.launch(stream, name, compute)
    return made


def factory(gpu: Gpu, func, args, kwargs):
    """``torch.empty/zeros/full/arange/...(device="cuda")``: a block, filled by a kernel."""
    with torch._C.DisableTorchFunction():
        shape_of = func(*args, **{**kwargs, "device": "meta"})
    stream = gpu.current_stream(kwargs["device"])
    out = empty(gpu, shape_of.shape, shape_of.dtype, shape_of.stride(), stream)
    if not func.__name__.startswith("empty"):  # memory as the allocator left it
        pointer = gpu.pointer(out)
        gpu.launch(stream, func.__name__, lambda: gpu.at(pointer).copy_(
            func(*args, **{**kwargs, "device": "cpu"})))
    return out


def from_host_data(gpu: Gpu, func, data, kwargs):
    """``torch.tensor/as_tensor(host data, device="cuda")``: a blocking copy."""
    with torch._C.DisableTorchFunction():
        host = func(data, **{**kwargs, "device": "cpu"})
    gpu.sync(f"torch.{func.__name__} of host data on the device (a blocking copy)")
    stream = gpu.current_stream(kwargs["device"])
    gpu.advance(stream, stream.query)
    out = empty(gpu, host.shape, host.dtype, stream=stream)
    _plain(out).copy_(host)
    return out


def _target(args, kwargs) -> tuple[torch.device | None, torch.dtype | None, bool]:
    """Where ``Tensor.to(*args, **kwargs)`` goes: ``(device, dtype, non_blocking)``."""
    if args and isinstance(args[0], torch.Tensor):  # .to(other): other's device and dtype
        other = args[0]
        device = other.device
        return device, _plain(other).dtype, bool(kwargs.get("non_blocking", False))
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype, non_blocking


def _device_to(gpu: Gpu, self, *args, **kwargs):
    device, dtype, _ = _target(args, kwargs)
    here = gpu.device_of(self)
    if device is not None and device.type == "cpu":
        return gpu.host_value("Tensor.to('cpu')", lambda: _plain(self).to(*args, **kwargs),
                              here)
    if device is not None and gpu.index(device) != here.index:
        self = _peer_copy(gpu, self, gpu.index(device))
    if dtype is None or dtype == self.dtype:
        return self
    return device_op(gpu, _convert, (self, dtype), {})


def _peer_copy(gpu: Gpu, tensor: DeviceTensor, index: int) -> DeviceTensor:
    """A copy to another device: on the destination's current stream, after the source's."""
    source, stream = gpu.current_stream(gpu.device_of(tensor)), gpu.current_stream(index)
    stream.wait_stream(source)
    out = empty(gpu, tensor.shape, tensor.dtype, tensor.stride(), stream)
    pointers = gpu.pointer(tensor), gpu.pointer(out)
    gpu.launch(stream, "peer copy", lambda: gpu.at(pointers[1]).copy_(gpu.at(pointers[0])))
    return out


_DEVICE_METHODS = {
    torch.Tensor.device.__get__: lambda gpu, self: gpu.device_of(self),
    torch.Tensor.is_cuda.__get__: lambda gpu, self: True,
    torch.Tensor.is_cpu.__get__: lambda gpu, self: False,
    torch.Tensor.__iter__: lambda gpu, self: iter(self.unbind(0)),
    torch.Tensor.__repr__: lambda gpu, self, *a, **k: f"DeviceTensor{tuple(self.shape)}",
}
for _method in (torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item):
    _DEVICE_METHODS[_method] = (lambda m: lambda gpu, self, *a, **k: gpu.host_value(
        f"Tensor.{m.__name__}()", lambda: m(_plain(self), *a, **k), gpu.device_of(self))
    )(_method)


# -- installing the model ----------------------------------------------------------------------

_FACTORIES = ("empty", "zeros", "ones", "full", "arange", "empty_strided", "rand", "randn",
              "zeros_like", "ones_like", "full_like", "empty_like")
_ABSENT = object()  # a class attribute that was only inherited
# What install() replaced while a model is installed: (owner, name, what it held).
_replaced: list[tuple[object, str, object]] = []


def _real_torch_in_child() -> None:
    """Give a child forked while a model is installed (a DataLoader worker) torch's own
    ``torch.cuda`` back, and everything else the model replaced. The child never sees the
    model's device, and on a machine with CUDA the model's answers break it: its
    ``torch.manual_seed`` trusts ``is_initialized()`` and seeds a device generator the child
    does not have (``IndexError`` on ``torch.cuda.default_generators``)."""
    for owner, name, original in reversed(_replaced):
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _replaced.clear()


os.register_at_fork(after_in_child=_real_torch_in_child)


def install(monkeypatch, gpu: Gpu) -> Gpu:
    """Make ``torch.cuda`` (and the tensor methods that reach it) the model, for one test; a
    process forked meanwhile gets torch's own back."""
    monkeypatch.setattr(sys.modules[__name__], "_replaced", [])  # emptied again after the test

    def replace(owner, name: str, value) -> None:
        held = (vars(owner).get(name, _ABSENT) if isinstance(owner, type)
                else getattr(owner, name, _ABSENT))  # absent: torch built without CUDA
        _replaced.append((owner, name, held))
        monkeypatch.setattr(owner, name, value, raising=held is not _ABSENT)

    replace(sys.modules[__name__], "_gpu", gpu)
    replace(torch.cuda, "is_available", lambda: True)
    replace(torch.cuda, "device_count", lambda: gpu.count)
    replace(torch.cuda, "current_device", gpu.current_device)
    replace(torch.cuda, "set_device", gpu.set_device)
    replace(torch.cuda, "device", gpu.device_guard)
    replace(torch.cuda, "set_stream", gpu.set_stream)
    replace(torch.cuda, "empty_cache", gpu.empty_cache)
    replace(torch.cuda, "is_current_stream_capturing", gpu.is_current_stream_capturing)
    replace(torch._C, "_cuda_hasPrimaryContext", lambda index: index in gpu.contexts)
    replace(torch.cuda, "memory_reserved", lambda device=None: gpu.allocator(device).reserved)
    replace(torch.cuda, "memory_allocated", lambda device=None: gpu.allocator(device).allocated)
    replace(torch.cuda, "max_memory_reserved",
            lambda device=None: gpu.allocator(device).peak_reserved)
    replace(torch.cuda, "reset_peak_memory_stats",
            lambda device=None: gpu.allocator(device).reset_peak())
    replace(torch.cuda, "mem_get_info", gpu.mem_get_info)
    replace(torch.cuda, "is_initialized", lambda: True)
    replace(torch.cuda, "Stream", gpu.pool_stream)
    replace(torch.cuda, "ExternalStream", gpu.external_stream)
    replace(torch.cuda, "Event", lambda *a, **k: Event(gpu))
    replace(torch.cuda, "stream", gpu.stream)
    replace(torch.cuda, "current_stream", gpu.current_stream)
    replace(torch.cuda, "default_stream", gpu.default_stream)
    replace(torch.cuda, "synchronize", gpu.synchronize)
    replace(page_lock, "TorchCudaRuntime", lambda: gpu.runtime)
    replace(own_streams, "libcuda", lambda: gpu.driver)
    replace(own_streams, "_streams", {})  # as in a new process: none made yet

    def to(self, *args, **kwargs):
        if isinstance(self, DeviceTensor):
            return _device_to(gpu, self, *args, **kwargs)
        device, dtype, non_blocking = _target(args, kwargs)
        if device is not None and device.type == "cuda":
            moved = to_device(gpu, self, non_blocking, device)
            return moved if dtype is None else moved.to(dtype)
        return _HOST_TO(self, *args, **kwargs)

    def cuda(self, device=None, non_blocking=False):
        index = gpu.index(device)
        return to(self, torch.device("cuda", index), non_blocking=non_blocking)

    def is_pinned(self, *args):
        return False if isinstance(self, DeviceTensor) else gpu.is_pinned(self)

    def pin_memory(self, *args):
        if isinstance(self, DeviceTensor):
            raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can "
                               "be pinned")
        # torch's: the same strides over a block of the pool sized to span them
        pinned = gpu.pinned_empty(self.shape, self.dtype, self.stride())
        with torch._C.DisableTorchFunction():
            pinned.copy_(self)
        return pinned

    def record_stream(self, stream):  # torch's parser refuses a stream it did not make
        if not isinstance(self, DeviceTensor):
            raise RuntimeError("record_stream of a tensor that is not on the device")
        gpu.record_stream(self, stream)

    for name, method in (("to", to), ("cuda", cuda), ("is_pinned", is_pinned),
                         ("pin_memory", pin_memory), ("record_stream", record_stream)):
        replace(torch.Tensor, name, method)

    for name in _FACTORIES:
        original = getattr(torch, name)

        def made_by(*args, _original=original, **kwargs):
            if kwargs.pop("pin_memory", False):  # the layout torch gives, in its pool
                made = _original(*args, **{**kwargs, "device": "meta"})
                return gpu.pinned_empty(made.shape, made.dtype, made.stride())
            if args and isinstance(args[0], DeviceTensor):  # *_like of a device tensor
                return device_op(gpu, _original, args, kwargs)
            if _is_cuda(kwargs.get("device")):
                device = torch.device("cuda", gpu.index(kwargs["device"]))
                return factory(gpu, _original, args, {**kwargs, "device": device})
            return _original(*args, **kwargs)

        replace(torch, name, made_by)

    for name in ("tensor", "as_tensor"):
        original = getattr(torch, name)

        def from_data(data, *args, _original=original, **kwargs):
            if not _is_cuda(kwargs.get("device")):
                return _original(data, *args, **kwargs)
            if isinstance(data, DeviceTensor):
                return data if _original.__name__ == "as_tensor" else device_op(
                    gpu, torch.Tensor.clone, (data,), {})
            return from_host_data(gpu, _original, data, kwargs)

        replace(torch, name, from_data)
    return gpu
