"""The CUDA calls fastfeed makes itself, on the modelled machine, with their real error codes:
``cudaHostRegister`` (the slot pool's page-locking, :class:`FakeRuntime`) and the driver API
that makes fastfeed's own streams (:class:`FakeLibcuda`, as ``ctypes`` maps libcuda.so.1)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from cuda_model.streams import Stream

if TYPE_CHECKING:
    from cuda_model.device import Gpu

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_CONTEXT = 201
# CUresult names, as cuGetErrorString gives them
ERROR_STRINGS = {1: b"invalid argument", 2: b"out of memory", 3: b"initialization error",
                 35: b"CUDA driver version is insufficient for CUDA runtime version",
                 100: b"no CUDA-capable device is detected", 101: b"invalid device ordinal",
                 201: b"invalid device context", 999: b"unknown error"}


class FakeRuntime:
    """The page-locking CUDA runtime (fastfeed.slots.page_lock.CudaRuntime): registration marks
    a range page-locked; ``refuse=True`` fails every registration."""

    def __init__(self, gpu: Gpu, refuse: bool = False) -> None:
        self.gpu, self.refuse = gpu, refuse

    def device(self, index: int):
        return self.gpu.device_guard(index)

    def host_register(self, address: int, nbytes: int) -> int:
        if self.refuse:
            return 1  # cudaErrorInvalidValue
        self.gpu.registered[address] = nbytes
        return 0

    def host_unregister(self, address: int) -> None:
        self.gpu.registered.pop(address, None)

    def clear_error(self, error: int) -> bool:
        return True


class FakeLibcuda:
    """libcuda.so.1 as ``ctypes`` maps it, for the calls that make a stream: each returns a
    ``CUresult`` and writes through its ``byref`` arguments. A context is current per thread
    (pushed and popped); ``cuStreamCreate`` makes a stream of the current context's device,
    none without one. Set ``fail`` to a ``CUresult`` to fail every call with it (no driver, a
    runtime newer than the driver...). ``calls`` counts the calls."""

    def __init__(self, gpu: Gpu) -> None:
        self.gpu = gpu
        self.fail = CUDA_SUCCESS
        self.calls = 0
        self.created: list[tuple[Stream, int]] = []  # (stream, flags), in order
        self._local = threading.local()

    def _call(self) -> int:
        self.calls += 1
        return self.fail

    def _stack(self) -> list[int]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    # the driver's own names
    def cuInit(self, flags: int) -> int:
        return self._call()

    def cuDeviceGet(self, device, ordinal: int) -> int:
        if error := self._call():
            return error
        if not 0 <= ordinal < self.gpu.count:
            return CUDA_ERROR_INVALID_DEVICE
        device._obj.value = ordinal
        return CUDA_SUCCESS

    def cuDevicePrimaryCtxRetain(self, context, device: object) -> int:
        if error := self._call():
            return error
        index = getattr(device, "value", device)
        self.gpu.touch(index)  # the primary context of the device asked for: created now
        context._obj.value = 0x1000 + index
        return CUDA_SUCCESS

    def cuCtxPushCurrent_v2(self, context: object) -> int:
        if error := self._call():
            return error
        self._stack().append(getattr(context, "value", context) - 0x1000)
        return CUDA_SUCCESS

    def cuCtxPopCurrent_v2(self, context) -> int:
        if error := self._call():
            return error
        if not self._stack():
            return CUDA_ERROR_INVALID_CONTEXT
        context._obj.value = 0x1000 + self._stack().pop()
        return CUDA_SUCCESS

    def cuStreamCreate(self, stream, flags: int) -> int:
        if error := self._call():
            return error
        if not self._stack():
            return CUDA_ERROR_INVALID_CONTEXT
        made = Stream(self.gpu, f"created{len(self.created)}", self._stack()[-1])
        self.created.append((made, flags))
        stream._obj.value = id(made)
        return CUDA_SUCCESS

    def cuGetErrorString(self, error: int, string) -> int:
        string._obj.value = ERROR_STRINGS.get(error, b"unknown error")
        return CUDA_SUCCESS

    def stream(self, handle: int) -> Stream:
        """The stream a handle names (``torch.cuda.ExternalStream``)."""
        return next(s for s, _ in self.created if id(s) == handle)
