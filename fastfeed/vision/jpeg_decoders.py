"""The GPU JPEG decoders the GPU decode route can use, behind one seam (:class:`JpegDecoder`),
chosen by name: TorchCodec's where an installed one can decode on the GPU, torchvision's where
not.

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

TorchCodec is often installed for audio or video, in a release older than its GPU JPEG decode:
it is chosen only where its ``decode_jpeg`` takes a ``device`` (what the route calls), else
torchvision's decoder is, and ``fastfeed info`` says why.

Errors come as the libraries raise them: torchvision wraps every one, out of memory included,
in ``RuntimeError("...Error while decoding JPEG images: ...")``; both report nvJPEG's status
codes at the end of their messages. torchvision before 0.29 wraps with ``TORCH_CHECK`` the
inner error's whole ``what()``, which ends with its C++ backtrace ("Exception raised from ...
(most recent call first):" and the frames), as every message does under
``TORCH_SHOW_CPP_STACKTRACES=1``: the status is read before that. They are sorted here: a file
the decoder cannot take is :class:`DecoderRefused` (decoded on the host instead), out of device
memory is :class:`DecoderOutOfMemory` (a ``torch.OutOfMemoryError`` that says whose allocation
failed: torch's, or nvJPEG's own ``cudaMalloc``: ``NVJPEG_STATUS_ALLOCATOR_FAILURE``), anything
else (a CUDA error) is raised as it came.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import os
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch

from fastfeed.device.own_streams import own_stream

__all__ = ["DECODERS", "DecoderOutOfMemory", "DecoderRefused", "JpegDecoder", "TorchcodecDecoder",
           "TorchvisionDecoder", "chosen_decoder", "describe", "jpeg_decoder"]


class DecoderRefused(RuntimeError):
    """The decoder cannot decode one of the files it was given (the file's fault)."""


class DecoderOutOfMemory(torch.OutOfMemoryError):
    """The device had no memory left for a decode. ``outside_torch``: the allocation that
    failed was the decoder's own (nvJPEG's ``cudaMalloc``), which memory torch's cache holds
    could serve; else it was torch's, whose allocator released its cache and tried again
    before it gave up."""

    def __init__(self, message: str, outside_torch: bool) -> None:
        super().__init__(message)
        self.outside_torch = outside_torch


class JpegDecoder(Protocol):
    """Decodes JPEG files to RGB on a device: ``3×H×W`` uint8 tensors, contiguous, safe to
    use on the caller's current stream, in the order given.

    Raises:
        DecoderRefused: it cannot decode one of the files.
        DecoderOutOfMemory: the device has no memory left for the decode.
    """

    def __call__(self, encoded: list[torch.Tensor], device: torch.device
                 ) -> list[torch.Tensor]: ...


# nvJPEG's statuses that are the bitstream's: INVALID_PARAMETER, BAD_JPEG, JPEG_NOT_SUPPORTED,
# INCOMPLETE_BITSTREAM; and ALLOCATOR_FAILURE, a cudaMalloc of its own that failed.
_FILE_STATUSES = {2, 3, 4, 10}
_ALLOCATOR_FAILURE = 5
_NVJPEG_STATUS = re.compile(r"(?:Failed to [\w ]+|nvjpegDecode failed): (\d+)\s*$")
# Where c10::Error's what() starts its C++ backtrace (c10/util/Exception.cpp).
_CPP_BACKTRACE = "\nException raised from "


def _sorted_error(error: RuntimeError) -> Exception:
    """``error`` of a decode as :class:`DecoderRefused`, :class:`DecoderOutOfMemory`, or
    itself (see the module's notes)."""
    message = str(error).split(_CPP_BACKTRACE, 1)[0]
    status = _NVJPEG_STATUS.search(message)
    code = int(status.group(1)) if status and "CUDA stream" not in status.group(0) else None
    if code == _ALLOCATOR_FAILURE or "out of memory" in message:
        return DecoderOutOfMemory(f"the GPU JPEG decoder is out of device memory: {message}",
                                  outside_torch=code == _ALLOCATOR_FAILURE)
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


def _decodes_on_gpu(module: Any) -> bool:
    """Whether TorchCodec's ``decoders`` module has the GPU JPEG decode: a ``decode_jpeg`` that
    takes a ``device`` (0.16 and later; older releases, installed for audio or video, have
    none)."""
    decode = getattr(module, "decode_jpeg", None)
    try:
        return decode is not None and "device" in inspect.signature(decode).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


# The decoders by name: (module, the decoder, whether the module imported can serve the route).
# Another (nvImageCodec's region decode) is one more entry.
DECODERS: dict[str, tuple[str, Callable[[], JpegDecoder], Callable[[Any], bool]]] = {
    "torchcodec": ("torchcodec.decoders", TorchcodecDecoder, _decodes_on_gpu),
    "torchvision": ("torchvision.io", TorchvisionDecoder, lambda module: True),
}
_PREFERRED = ("torchcodec", "torchvision")


def _usable(name: str) -> str | None:
    """None where decoder ``name`` can serve here; else why not."""
    module_name, _, capable = DECODERS[name]
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # missing, or built for another torch (an OSError...)
        return f"{name} does not import ({type(error).__name__})"
    if not capable(module):
        return (f"{name} {_version(name)} has no GPU JPEG decode (decode_jpeg(device=...): "
                "0.16 or later)")
    return None


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def chosen_decoder(name: str | None = None) -> str | None:
    """The decoder ``name`` means: given, ``FASTFEED_JPEG_DECODER``, or ``"auto"``: the first
    of TorchCodec and torchvision that can decode here (None: neither can)."""
    name = name or os.environ.get("FASTFEED_JPEG_DECODER") or "auto"
    if name != "auto":
        if name not in DECODERS:
            raise ValueError(f"unknown JPEG decoder {name!r}: one of {sorted(DECODERS)} or "
                             "'auto'")
        return name
    return next((n for n in _PREFERRED if _usable(n) is None), None)


def jpeg_decoder(name: str | None = None) -> JpegDecoder:
    """The :class:`JpegDecoder` ``name`` means (:func:`chosen_decoder`).

    Raises:
        ImportError: no decoder can decode here, or the one named cannot.
    """
    chosen = chosen_decoder(name)
    if chosen is None:
        raise ImportError("fastfeed's GPU JPEG decode needs torchcodec (0.16 or later) or "
                          "torchvision: pip install torchcodec")
    why_not = _usable(chosen)
    if why_not is not None:  # named: say so at once, not at every batch
        raise ImportError(f"the GPU JPEG decoder {chosen!r} cannot decode here: {why_not}")
    return DECODERS[chosen][1]()


def describe() -> str:
    """The GPU decode's decoder here, for ``fastfeed info``."""
    try:
        chosen = chosen_decoder()
    except ValueError as error:
        return str(error)
    passed_over = _usable("torchcodec") if chosen != "torchcodec" else None
    if chosen is None:
        return f"none: pip install torchcodec (or torchvision) for the GPU decode ({passed_over})"
    how = ("FASTFEED_JPEG_DECODER" if os.environ.get("FASTFEED_JPEG_DECODER") not in
           (None, "", "auto") else "auto")
    if chosen == "torchcodec":
        advice = ""
    elif passed_over is not None and "does not import" not in passed_over:
        advice = f"; {passed_over}: pip install -U torchcodec"
    else:
        advice = "; pip install torchcodec: one decoder per device, no stream of torch's pool"
    return f"{chosen} {_version(chosen)} ({how}{advice})"
