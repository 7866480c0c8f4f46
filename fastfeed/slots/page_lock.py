"""Page-locking pool slots for one CUDA device (``cudaHostRegister``), failing soft.

Registering is done only for loaders that copy batches to a CUDA device themselves
(``device="cuda"``): fastfeed then owns every copy out of a slot and fences the slot until
the copy's event completes (see :mod:`fastfeed.slots`). Memory the user copies from
(``pin_memory=True``) is never a registered slot: torch protects only the pinned memory its
own allocator handed out.

Three CUDA rules live here:

* Registration runs under a guard for the loader's device, so that a rank does not create a
  context on GPU 0 (the current device of a fresh process).
* A failed registration's error is read back (``cudaGetLastError``) in the CUDA runtime that
  holds it; left unread, torch's next kernel-launch check would report it against an
  unrelated kernel. A process may map several runtimes (torch's, CuPy's, TensorRT's): the one
  torch's binding set the error in is the one whose ``cudaPeekAtLastError`` shows it. Where
  none does (a runtime linked in statically), the error cannot be read back: that is logged,
  and no slot is registered again.
* A slot that could not be registered is reported once; copies from it are then staged
  through torch's pinned pool (:func:`fastfeed.device.pinned_source`), never silently
  synchronous.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["CudaRuntime", "PageLocker", "TorchCudaRuntime"]

logger = logging.getLogger(__name__)


class CudaRuntime(Protocol):
    """The few CUDA runtime calls page-locking needs (a fake one stands in for it in tests)."""

    def device(self, index: int) -> contextlib.AbstractContextManager[Any]: ...

    def host_register(self, address: int, nbytes: int) -> int: ...

    def host_unregister(self, address: int) -> None: ...

    def clear_error(self, error: int) -> bool:
        """Read back ``error`` where the last call left it; False if it could not be."""
        ...


def _mapped_runtimes() -> list[Any]:
    """Every CUDA runtime library mapped into this process, whoever loaded it."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return []
    runtimes = []
    for path in sorted(paths):
        with contextlib.suppress(OSError):
            runtimes.append(ctypes.CDLL(path))  # already mapped: this only takes a handle
    return runtimes


class TorchCudaRuntime:
    """torch's bindings of the CUDA runtime (``torch.cuda.cudart()``).

    Args:
        cudart: the bindings; torch's by default.
    """

    def __init__(self, cudart: Any = None) -> None:
        self._cudart = torch.cuda.cudart() if cudart is None else cudart
        self._runtimes: list[Any] | None = None

    def device(self, index: int) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.device(index)

    def host_register(self, address: int, nbytes: int) -> int:
        return int(self._cudart.cudaHostRegister(address, nbytes, 0))

    def host_unregister(self, address: int) -> None:
        self._cudart.cudaHostUnregister(address)

    def clear_error(self, error: int) -> bool:
        # torch binds no cudaGetLastError; the runtime its binding called has one. Another
        # runtime's pending error (CuPy's, in this thread) is not fastfeed's to read.
        holders = [rt for rt in self._mapped() if rt.cudaPeekAtLastError() == error]
        for runtime in holders:
            runtime.cudaGetLastError()
        return bool(holders)

    def _mapped(self) -> list[Any]:
        if self._runtimes is None:
            self._runtimes = _mapped_runtimes()
        return self._runtimes


@dataclass
class PageLocker:
    """Page-locks host arrays (registers them with CUDA) for CUDA device ``device_index``.

    Args:
        device_index: the device the page-locked memory is copied to.
        runtime: the CUDA runtime; ``None`` means torch's, bound on first use.
    """

    device_index: int
    runtime: CudaRuntime | None = field(default=None, repr=False, compare=False)
    failures: int = field(default=0, compare=False)
    # A failure whose error could not be read back: registering again would leave another.
    stopped: bool = field(default=False, compare=False)

    def register(self, array: np.ndarray) -> bool:
        """Page-lock ``array`` until it is garbage-collected; False (logged) if CUDA refuses."""
        if self.stopped:
            return False
        if self.runtime is None:
            self.runtime = TorchCudaRuntime()
        runtime = self.runtime
        address = int(array.ctypes.data)
        with runtime.device(self.device_index):
            error = runtime.host_register(address, array.nbytes)
            read_back = error == 0 or runtime.clear_error(error)
        if error != 0:
            self.failures += 1
            if not read_back:
                self.stopped = True
                logger.error("cudaHostRegister failed (error %d) and no CUDA runtime library of "
                             "this process holds the error (a statically linked runtime?): torch "
                             "may report it against its next kernel. Pool slots are no longer "
                             "page-locked; copies are staged through torch's pinned memory",
                             error)
            elif self.failures == 1:
                logger.warning("cudaHostRegister failed (error %d) for a %d-byte pool slot; "
                               "copies from it are staged through torch's pinned memory",
                               error, array.nbytes)
            return False
        weakref.finalize(array, _unregister, runtime, self.device_index, address).atexit = False
        return True

    def __getstate__(self) -> dict[str, Any]:
        return {"device_index": self.device_index, "runtime": None, "failures": 0,
                "stopped": False}


def _unregister(runtime: CudaRuntime, device_index: int, address: int) -> None:
    with runtime.device(device_index):
        runtime.host_unregister(address)
