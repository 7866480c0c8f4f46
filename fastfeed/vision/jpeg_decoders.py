"""The GPU JPEG decoders the GPU decode route can use, behind one seam (:class:`JpegDecoder`),
chosen by name: TorchCodec's where it is installed, torchvision's where not.

Both decode a batch of files with nvJPEG in one call (the hardware JPEG engine of A100/H100
for the baseline files it takes), on the process's decode stream
(:func:`~fastfeed.device.own_streams.own_stream`, made as the current stream for the call; the
caller's stream then waits for it). They differ where it matters to a user with several GPUs:

- **TorchCodec** (``torchcodec.decoders.decode_jpeg(files, device="cuda")``, 0.16+) keeps one
  decoder per device, allocates and decodes on the current stream (the decode stream, on which
  nothing else runs) and waits on the host for that stream once a call. It applies a file's
  EXIF orientation, which the CPU route (Pillow) does not: such files are the workers' (see
  :func:`fastfeed.vision.gpu_decode.gpu_decodable`).
- **torchvision** (``torchvision.io.decode_jpeg(device="cuda")``, deprecated in 0.29) keeps one
  decoder for the process: for a device other than the one it was built for it builds another,
  and leaks the first, at every call. So a process decodes on one device only: a second is
  refused, with the way out. Its decoder writes on a stream it takes from torch's pool when it
  is built, which it synchronises on the host twice a call: a stream shared with whoever else
  was handed it (NCCL, the user), whose work that wait then includes. fastfeed's own streams
  are never in the pool, so it is never the copy stream.

Errors come as the libraries raise them: torchvision wraps every one, out of memory included,
in ``RuntimeError("...Error while decoding JPEG images: ...")``; both report nvJPEG's status
codes at the end of their messages. They are sorted here: a file the decoder cannot take is
:class:`DecoderRefused` (decoded on the host instead), out of device memory is
``torch.OutOfMemoryError`` (torch's own, or nvJPEG's ``cudaMalloc`` failing:
``NVJPEG_STATUS_ALLOCATOR_FAILURE``), anything else (a CUDA error) is raised as it came.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import re
import threading
import warnings
from collections.abc import Callable
from typing import Protocol

import torch

from fastfeed.device.own_streams import own_stream

__all__ = ["DECODERS", "DecoderRefused", "JpegDecoder", "TorchcodecDecoder",
           "TorchvisionDecoder", "chosen_decoder", "describe", "jpeg_decoder"]


class DecoderRefused(RuntimeError):
    """The decoder cannot decode one of the files it was given (the file's fault)."""


class JpegDecoder(Protocol):
    """Decodes JPEG files to RGB on a device: ``3×H×W`` uint8 tensors, contiguous, safe to
    use on the caller's current stream, in the order given.

    Raises:
        DecoderRefused: it cannot decode one of the files.
        torch.OutOfMemoryError: the device has no memory left for the decode.
    """

    def __call__(self, encoded: list[torch.Tensor], device: torch.device
                 ) -> list[torch.Tensor]: ...


# nvJPEG's statuses that are the bitstream's: INVALID_PARAMETER, BAD_JPEG, JPEG_NOT_SUPPORTED,
# INCOMPLETE_BITSTREAM; and ALLOCATOR_FAILURE, a cudaMalloc of its own that failed.
_FILE_STATUSES = {2, 3, 4, 10}
_ALLOCATOR_FAILURE = 5
_NVJPEG_STATUS = re.compile(r"(?:Failed to [\w ]+|nvjpegDecode failed): (\d+)\s*$")


def _sorted_error(error: RuntimeError) -> Exception:
    """``error`` of a decode as :class:`DecoderRefused`, ``torch.OutOfMemoryError``, or
    itself (see the module's notes)."""
    message = str(error)
    status = _NVJPEG_STATUS.search(message)
    code = int(status.group(1)) if status and "CUDA stream" not in status.group(0) else None
    if "out of memory" in message or code == _ALLOCATOR_FAILURE:
        return torch.OutOfMemoryError(f"the GPU JPEG decoder is out of device memory: "
                                      f"{message}")
    if code in _FILE_STATUSES or "Unknown chroma subsampling" in message:
        return DecoderRefused(message)
    return error


def _on_decode_stream(decode: Callable[[], list[torch.Tensor]], device: torch.device
                      ) -> list[torch.Tensor]:
    """``decode()`` with the decode stream current; its images safe on the caller's."""
    stream = own_stream(device, "decode")  # its failure is no file's: raised as it is
    caller = torch.cuda.current_stream(device)
    try:
        # The device too, not only its stream: leaving a stream context on another device
        # restores this thread's previous stream by setting its device (a context on GPU 0).
        with torch.cuda.device(device), torch.cuda.stream(stream):
            images = decode()
    except RuntimeError as error:
        sorted_error = _sorted_error(error)
        if sorted_error is error:
            raise
        raise sorted_error from error
    caller.wait_stream(stream)
    for image in images:
        image.record_stream(caller)
    return images


class TorchcodecDecoder:
    """:class:`JpegDecoder` by TorchCodec's ``decode_jpeg`` (see the module's notes)."""

    def __call__(self, encoded: list[torch.Tensor], device: torch.device
                 ) -> list[torch.Tensor]:
        from torchcodec.decoders import decode_jpeg  # optional: needed only here

        if not encoded:
            return []
        if device.type != "cuda":
            return list(decode_jpeg(encoded, mode="RGB"))
        return list(_on_decode_stream(lambda: decode_jpeg(encoded, mode="RGB", device=device),
                                      device))


# torchvision 0.29 deprecates its image decoders (TorchCodec replaces them) and warns at every
# call, from this module: that one warning is silenced, once, for the process (a filter, as
# warnings.catch_warnings is not thread-safe and the decode runs in a helper thread).
_DEPRECATION = "The image decoding and encoding capabilities of TorchVision are deprecated"
_DEPRECATED_IN = r"torchvision\.io\.image\Z"


@functools.cache
def _quiet_torchvision_deprecation() -> None:
    warnings.filterwarnings("ignore", message=re.escape(_DEPRECATION),
                            category=DeprecationWarning, module=_DEPRECATED_IN)


_torchvision_device: dict[str, int] = {}  # "built for" -> the device of the process's decoder
_torchvision_lock = threading.Lock()
os.register_at_fork(after_in_child=_torchvision_device.clear)


def _claim_torchvision(index: int) -> None:
    with _torchvision_lock:
        built_for = _torchvision_device.setdefault("built for", index)
    if built_for != index:
        raise RuntimeError(
            f"fastfeed's GPU JPEG decode through torchvision serves one device per process "
            f"(cuda:{built_for}); this batch is for cuda:{index}. torchvision keeps one decoder "
            "and would rebuild it, leaking the last, at every call. Install torchcodec (one "
            "decoder per device), or decode on one device per process (one per DDP rank).")


class TorchvisionDecoder:
    """:class:`JpegDecoder` by ``torchvision.io.decode_jpeg`` (see the module's notes); on a
    CPU device, torchvision's CPU decoder."""

    def __call__(self, encoded: list[torch.Tensor], device: torch.device
                 ) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg  # optional: needed only here

        if not encoded:
            return []
        _quiet_torchvision_deprecation()
        if device.type != "cuda":
            return decode_jpeg(encoded, device=device, mode=ImageReadMode.RGB)
        index = device.index if device.index is not None else torch.cuda.current_device()
        _claim_torchvision(index)
        return _on_decode_stream(lambda: decode_jpeg(encoded, device=torch.device("cuda", index),
                                                     mode=ImageReadMode.RGB), device)


# The decoders by name: another (nvImageCodec's region decode) is one more entry.
DECODERS: dict[str, tuple[str, Callable[[], JpegDecoder]]] = {
    "torchcodec": ("torchcodec.decoders", TorchcodecDecoder),
    "torchvision": ("torchvision.io", TorchvisionDecoder),
}
_PREFERRED = ("torchcodec", "torchvision")


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # missing, or built for another torch (an OSError, a RuntimeError)
        return False
    return True


def chosen_decoder(name: str | None = None) -> str | None:
    """The decoder ``name`` means: given, ``FASTFEED_JPEG_DECODER``, or ``"auto"``: the first
    of TorchCodec and torchvision that imports here (None: neither does)."""
    name = name or os.environ.get("FASTFEED_JPEG_DECODER") or "auto"
    if name != "auto":
        if name not in DECODERS:
            raise ValueError(f"unknown JPEG decoder {name!r}: one of {sorted(DECODERS)} or "
                             "'auto'")
        return name
    return next((n for n in _PREFERRED if _imports(DECODERS[n][0])), None)


def jpeg_decoder(name: str | None = None) -> JpegDecoder:
    """The :class:`JpegDecoder` ``name`` means (:func:`chosen_decoder`).

    Raises:
        ImportError: neither decoder imports here.
    """
    chosen = chosen_decoder(name)
    if chosen is None:
        raise ImportError("fastfeed's GPU JPEG decode needs torchcodec (0.16 or later) or "
                          "torchvision: pip install torchcodec")
    return DECODERS[chosen][1]()


def describe() -> str:
    """The GPU decode's decoder here, for ``fastfeed info``."""
    try:
        chosen = chosen_decoder()
    except ValueError as error:
        return str(error)
    if chosen is None:
        return "none: pip install torchcodec (or torchvision) for the GPU decode"
    how = ("FASTFEED_JPEG_DECODER" if os.environ.get("FASTFEED_JPEG_DECODER") not in
           (None, "", "auto") else "auto")
    version = importlib.metadata.version(chosen)
    advice = ("" if chosen == "torchcodec" else
              "; pip install torchcodec: one decoder per device, no stream of torch's pool")
    return f"{chosen} {version} ({how}{advice})"
