"""The GPU JPEG decoders on the modelled machine (``cuda_model``), as their C++ runs them:
torchvision's ``decode_jpegs_cuda.cpp`` (``torchvision.io.decode_jpeg(device="cuda")``) and
TorchCodec's ``DecodeJpegCuda.cpp`` (``torchcodec.decoders.decode_jpeg(..., device="cuda")``).

- **torchvision** keeps one decoder per process, built for one device; a call for another
  device builds a new one and leaks the last (its destructor frees nothing). A decoder writes
  on a stream it takes from torch's pool when it is built (``getStreamFromPool``), which it
  synchronises on the host twice a call; its outputs are allocated on the caller's current
  stream; in ``UNCHANGED`` mode a greyscale image is cloned on the current stream. Every error
  of a decode, out of memory included, is wrapped: ``"decode_jpegs_cuda, <file>:<line>, Error
  while decoding JPEG images: <the error>"`` (0.29's ``STD_TORCH_CHECK``). Before 0.29
  (``version=(0, 28)``) its checks were ``TORCH_CHECK``: each error a ``c10::Error`` whose
  ``what()``, wrapped whole, ends with the inner error's C++ backtrace: ``"Error while decoding
  JPEG images: <the error>\nException raised from <function> at <file>:<line> (most recent
  call first):\nframe #0: ..."``.
- **TorchCodec** keeps decoders per device, allocates and decodes on the current stream and
  synchronises it once a call; its errors are raised as they are.

Both call ``cudaMalloc`` themselves for nvJPEG's working memory, outside torch's cache (kept
and grown with the largest batch): when it fails, nvJPEG's ``NVJPEG_STATUS_ALLOCATOR_FAILURE``
(5); a file it cannot take fails the whole call with its bitstream status. The pixels are
Pillow's (the decode stand-in): what nvJPEG does differently (no fancy chroma upsampling, its
IDCT) is measured on a GPU."""

from __future__ import annotations

import enum
import io
import sys
import types

import numpy as np
import torch
from cuda_model.streams import Kernel
from PIL import Image

from fastfeed.vision import jpeg_decoders

# What nvJPEG's state takes besides the images (its buffers, the Huffman tables...)
WORKSPACE = 4 << 20
_BAD_JPEG, _NOT_SUPPORTED, _ALLOCATOR_FAILURE = 3, 4, 5


class ImageReadMode(enum.Enum):
    UNCHANGED, GRAY, RGB = 0, 1, 3


def decode_with_pillow(data, device=None, mode=ImageReadMode.RGB):
    """torchvision.io.decode_jpeg's contract on the CPU: a list of C×H×W uint8."""
    images = []
    for item in data:
        image = Image.open(io.BytesIO(np.asarray(item).tobytes()))
        if mode.name == "RGB" or image.mode != "L":
            image = image.convert("RGB")
        array = np.asarray(image)
        images.append(torch.from_numpy(array.reshape(*array.shape[:2], -1).copy())
                      .permute(2, 0, 1).contiguous())
    return images


def checked(function: str, source: str, message: str) -> RuntimeError:
    """An error as the stable ABI's STD_TORCH_CHECK raises it."""
    return RuntimeError(f"{function}, /__w/{source}:212, {message}")


def with_backtrace(function: str, source: str, message: str) -> str:
    """A ``c10::Error``'s ``what()``: its message, then its C++ backtrace."""
    return (f"{message}\nException raised from {function} at /__w/{source}:212 (most recent "
            "call first):\nframe #0: c10::Error::Error(c10::SourceLocation, std::string) + "
            "0x98 (0x7f3e in libc10.so)\nframe #1: <unknown function> + 0x4c1d (0x7f2a in "
            "image.so)\n")


class _Nvjpeg:
    """One decoder's nvJPEG state on device ``index``: its working memory, the library's own
    ``cudaMalloc``, grown to the largest batch."""

    def __init__(self, gpu, index: int) -> None:
        self.gpu, self.index = gpu, index
        self.memory = gpu.allocators[index].memory
        self.held: tuple[int, int] | None = None  # (offset, bytes)

    def workspace(self, nbytes: int) -> bool:
        need = WORKSPACE + nbytes
        if self.held is not None and self.held[1] >= need:
            return True
        if self.held is not None:
            self.memory.driver_free(self.held[0])
            self.held = None
        offset = self.memory.driver_malloc(need)
        if offset is None:
            return False
        self.held = (offset, need)
        return True


class ModelDecoder:
    """What both models share: the files checked and decoded (by Pillow), nvJPEG's memory,
    and what the tests read: ``calls``, ``streams`` (the caller's current stream per call),
    ``read_in_slot`` (per file: read where the worker left it), ``refused`` (the files, as
    bytes, nvJPEG refuses as it refuses a corrupt one) and ``waited_for`` (the kernels of
    others its host waits made the host wait for)."""

    function, source = "", ""
    version = (0, 29)

    def __init__(self, gpu) -> None:
        self.gpu = gpu
        self.refused: set[bytes] = set()
        self.read_in_slot: list[bool] = []
        self.streams: list = []
        self.waited_for: list[str] = []
        self.calls = 0

    def synchronize(self, stream) -> None:
        """cudaStreamSynchronize: the host waits for all of ``stream``'s work, others' too."""
        self.waited_for += [item.name for item in stream.queue
                            if isinstance(item, Kernel) and item.name != "write"]
        stream.synchronize()

    def error(self, message: str) -> RuntimeError:
        if self.version < (0, 29):
            return RuntimeError(with_backtrace("decode_images", self.source, message))
        return checked("decode_images", self.source, message)

    def prepare(self, data, index: int, state: _Nvjpeg):
        """The files' pixels (Pillow's), once nvJPEG has taken them and its memory."""
        self.calls += 1
        self.streams.append(self.gpu.current_stream(index))
        for item in data:
            if bytes(item[:2].tolist()) != b"\xff\xd8":
                raise self.error(f"Failed to get image info: {_BAD_JPEG}")
            self.read_in_slot.append(any(start <= item.data_ptr() < start + n
                                         for start, n in self.gpu.registered.items()))
        if any(item.numpy().tobytes() in self.refused for item in data):  # fails the call
            raise self.error(f"Failed to decode batch: {_NOT_SUPPORTED}")
        try:
            pixels = decode_with_pillow(data, mode=ImageReadMode.RGB)
        except Exception:
            raise self.error(f"Failed to decode batch: {_BAD_JPEG}") from None
        if not state.workspace(sum(p.numel() for p in pixels)):
            raise self.error(f"Failed to decode batch: {_ALLOCATOR_FAILURE}")
        return pixels

    def outputs(self, pixels, index: int) -> list[torch.Tensor]:
        """torch's empty on the device, on its current stream; torch's out of memory as the
        stable ABI passes it on."""
        try:
            return [torch.empty(p.shape, dtype=torch.uint8, device=torch.device("cuda", index))
                    for p in pixels]
        except torch.OutOfMemoryError as error:
            if self.version < (0, 29):  # c10::OutOfMemoryError, a c10::Error
                raise RuntimeError(with_backtrace("malloc", "pytorch/c10/cuda/"
                                                  "CUDACachingAllocator.cpp", str(error))) from None
            raise RuntimeError(f"{error} (originally from aoti_torch_empty_strided API call "
                               "failed at torch/csrc/stable/ops.h, line 212)") from None


class TorchvisionDecoder(ModelDecoder):
    """``torchvision.io.decode_jpeg(device="cuda")`` (see the module's notes). ``built`` lists
    each decoder built, by device; all but the last are leaked."""

    source = "vision/vision/torchvision/csrc/io/image/cuda/decode_jpegs_cuda.cpp"

    def __init__(self, gpu, version: tuple[int, int] = (0, 29)) -> None:
        super().__init__(gpu)
        self.version = version
        self.built: list[int] = []
        self.stream = None  # the decoder's, from torch's pool
        self.state: _Nvjpeg | None = None

    def __call__(self, data, device=None, mode=ImageReadMode.UNCHANGED):
        if device is None or torch.device(device).type == "cpu":
            return decode_with_pillow(data, mode=mode)
        index = self.gpu.index(device)
        with self.gpu.device_guard(index):  # at::cuda::CUDAGuard
            if not self.built or self.built[-1] != index:
                self.built.append(index)  # the last one's nvJPEG state is leaked
                self.stream = self.gpu.pool_stream(index)
                self.state = _Nvjpeg(self.gpu, index)
            try:
                return self._decode(data, index, mode)
            except Exception as error:
                if self.version < (0, 29):  # TORCH_CHECK(false, "...", e.what())
                    raise RuntimeError(f"Error while decoding JPEG images: {error}") from None
                raise checked("decode_jpegs_cuda", self.source,
                              f"Error while decoding JPEG images: {error}") from None

    def _decode(self, data, index: int, mode):
        pixels = self.prepare(data, index, self.state)
        grey = [Image.open(io.BytesIO(np.asarray(d).tobytes())).mode == "L" for d in data]
        outputs = self.outputs(pixels, index)
        self.synchronize(self.stream)
        for output, values in zip(outputs, pixels, strict=True):
            self.gpu.write(self.stream, output, values)
        self.synchronize(self.stream)
        if mode.name == "UNCHANGED":  # channels sliced off on the current stream
            outputs = [o[0].unsqueeze(0).clone() if g else o for o, g in zip(outputs, grey,
                                                                             strict=True)]
        event = torch.cuda.Event()
        event.record(self.stream)
        self.gpu.current_stream(index).wait_event(event)
        return outputs


class TorchcodecDecoder(ModelDecoder):
    """``torchcodec.decoders.decode_jpeg(files, device="cuda")`` (see the module's notes).
    ``states`` holds the decoder of each device."""

    source = "torchcodec/torchcodec/src/torchcodec/_core/DecodeJpegCuda.cpp"

    def __init__(self, gpu) -> None:
        super().__init__(gpu)
        self.states: dict[int, _Nvjpeg] = {}

    def __call__(self, source, *, mode="RGB", device="cpu"):
        if torch.device(device).type == "cpu":
            return decode_with_pillow(source, mode=ImageReadMode[str(mode).upper()])
        index = self.gpu.index(device)
        with self.gpu.device_guard(index):
            state = self.states.setdefault(index, _Nvjpeg(self.gpu, index))
            stream = self.gpu.current_stream(index)
            pixels = self.prepare(source, index, state)
            outputs = self.outputs(pixels, index)
            for output, values in zip(outputs, pixels, strict=True):
                self.gpu.write(stream, output, values)
            self.synchronize(stream)  # its buffers go back to the cache: their work done
        return outputs


def _module(monkeypatch, name: str) -> types.ModuleType:
    """``name``, imported, or a stand-in where it is missing (or built for another torch)."""
    try:
        __import__(name)
    except Exception:
        parent = name.rpartition(".")[0]
        for module in (parent, name):
            monkeypatch.setitem(sys.modules, module, types.ModuleType(module))
        monkeypatch.setattr(sys.modules[parent], name.rpartition(".")[2], sys.modules[name],
                            raising=False)
    return sys.modules[name]


def install(monkeypatch, gpu, library: str = "torchvision") -> ModelDecoder:
    """Make ``library``'s GPU JPEG decode (``"torchvision"``, ``"torchvision 0.28"``: its
    errors before 0.29, or ``"torchcodec"``) the modelled one, and the one fastfeed chooses;
    as in a new process, no decoder is made yet."""
    library, _, version = library.partition(" ")
    monkeypatch.setattr(jpeg_decoders, "_torchvision_device", {})
    monkeypatch.setenv("FASTFEED_JPEG_DECODER", library)
    if library == "torchvision":
        decoder: ModelDecoder = TorchvisionDecoder(
            gpu, tuple(map(int, version.split("."))) if version else (0, 29))
        module = _module(monkeypatch, "torchvision.io")
        monkeypatch.setattr(module, "ImageReadMode", getattr(module, "ImageReadMode",
                                                             ImageReadMode), raising=False)
    else:
        decoder = TorchcodecDecoder(gpu)
        module = _module(monkeypatch, "torchcodec.decoders")
    monkeypatch.setattr(module, "decode_jpeg", decoder, raising=False)
    return decoder
