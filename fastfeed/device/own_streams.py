"""fastfeed's own CUDA streams, outside torch's pool: the copy stream and the GPU decode's.

``torch.cuda.Stream()`` makes no stream: it hands out the next of 32 pooled streams per device,
round-robin, and so do the libraries built on torch (torchvision's JPEG decoder, NCCL's
communicators). A pooled copy stream can therefore be the stream torchvision's decoder
synchronises on the host, or the user's, or NCCL's. So fastfeed makes its streams itself,
once per process, device and purpose, and never destroys them (no stream per epoch or per
loader).

They are made through the CUDA driver API (libcuda, one per process, whichever CUDA runtimes
are mapped): ``cuStreamCreate`` with ``CU_STREAM_NON_BLOCKING`` (as torch's pooled streams: no
implicit wait on the legacy default stream) in the device's primary context (torch's), pushed
for the call and popped after. The thread's current device is not touched: no
``cudaSetDevice``, whose restore would make a context on another GPU.

A failure (no driver mapped, a driver older than the runtime) is raised with the driver's own
error, and remembered: asking again raises it again without calling the driver.

On ROCm there is no libcuda (torch's ``cuda`` is HIP there): the streams are then torch's
pooled ones, shared as above.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import torch

__all__ = ["OwnStreamError", "create_stream", "libcuda", "own_stream"]

_CU_STREAM_NON_BLOCKING = 0x1


class OwnStreamError(RuntimeError):
    """fastfeed could not make one of its CUDA streams: nothing on that device can run."""


def libcuda() -> Any:
    """The CUDA driver library (mapped already wherever torch has initialised CUDA)."""
    return ctypes.CDLL("libcuda.so.1")


def _check(lib: Any, result: int, call: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(name))
        what = name.value.decode() if name.value else "unknown error"
        raise OwnStreamError(f"{call} failed: CUDA driver error {result} ({what})")


def create_stream(lib: Any, index: int) -> int:
    """A new non-blocking stream of device ``index``, through the driver API ``lib``: its
    handle (``cudaStream_t``), for ``torch.cuda.ExternalStream``.

    Raises:
        OwnStreamError: the driver refused a call (its error code and name in the message).
    """
    _check(lib, lib.cuInit(0), "cuInit")
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check(lib, lib.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
    _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
           "cuDevicePrimaryCtxRetain")
    _check(lib, lib.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
    stream = ctypes.c_void_p()
    try:
        _check(lib, lib.cuStreamCreate(ctypes.byref(stream), _CU_STREAM_NON_BLOCKING),
               "cuStreamCreate")
    finally:
        lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    return int(stream.value or 0)


def _new_stream(index: int) -> Any:
    """A stream of device ``index``: made through the driver, or on ROCm torch's pooled one."""
    device = torch.device("cuda", index)
    if torch.version.hip:
        return torch.cuda.Stream(device)
    return torch.cuda.ExternalStream(create_stream(libcuda(), index), device=device)


_streams: dict[tuple[str, int], Any] = {}  # (purpose, device index) -> stream, or its error
_lock = threading.Lock()
os.register_at_fork(after_in_child=_streams.clear)  # CUDA objects do not cross a fork


def own_stream(device: torch.device, purpose: str) -> Any:
    """The process's stream for ``purpose`` (``"copy"``, ``"decode"``) on CUDA ``device``,
    made on first use (see the module's notes).

    Raises:
        OwnStreamError: the driver could not make it (now, or the first time).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        stream = _streams.get((purpose, index))
        if stream is None:
            try:
                stream = _new_stream(index)
            except (OSError, OwnStreamError) as error:  # OSError: no driver library
                stream = OwnStreamError(f"fastfeed cannot make its {purpose} stream on "
                                        f"cuda:{index}: {error}")
            _streams[(purpose, index)] = stream
    if isinstance(stream, OwnStreamError):
        raise OwnStreamError(*stream.args)
    return stream
