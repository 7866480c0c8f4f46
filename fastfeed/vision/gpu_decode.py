"""Batches of JPEG files decoded on the GPU, then cropped, resized, flipped and normalised there:
what the ``"nvjpeg"`` backend and ``accelerate(..., decode_device="cuda")`` share.

Workers read each file, parse only its header (the crop window is drawn from the image size)
and hand over an :class:`EncodedCrop`: the encoded bytes and the window, or, for a file nvJPEG
cannot take (see :func:`gpu_decodable`: ImageNet has a PNG named ``.JPEG`` and CMYK JPEGs),
the crop decoded by the worker on the CPU. :func:`collate_crops` makes one batch of them (the
bytes as numpy arrays, which device prefetch leaves on the host; the geometry as one array of
host numbers). On the copy stream, :class:`DecodeCrops` decodes the batch's files with one call
to the decoder (:class:`NvjpegDecoder`: ``torchvision.io.decode_jpeg(device="cuda")``, nvJPEG,
with A100's and H100's hardware JPEG engine for the baseline files it accepts), then resizes the
whole batch with :func:`fastfeed.vision.resample.resize_crops`: a dozen kernels a batch.

Three rules keep the decode from stalling the training thread or racing the copy stream:

- Nothing reads a device value back (``.tolist()``, ``.item()``, ``.cpu()``, ``if tensor``):
  that would make the host wait for every kernel queued on the GPU. The windows and the image
  sizes are what the host needs, so they stay on the host, and the tables built from them cross
  to the device in one asynchronous copy.
- No buffer is written by a stream that does not wait for the buffer's previous users.
  torchvision's decoder allocates its outputs on the caller's current stream but writes them
  on a private stream that waits for nothing, then makes the caller wait for it. On the copy
  stream, that could hand the decoder a block the caching allocator just freed there, while
  kernels queued on the copy stream still read it. So the decode runs with a stream of our
  own as the current one, on which no kernel ever runs: its blocks are freed only once the
  copy stream's recorded uses complete (``record_stream``), and the copy stream waits for it
  before touching the images. Outputs are asked for in RGB: in its ``UNCHANGED`` mode the
  decoder clones a greyscale image on the current stream, a kernel there, and frees the
  original with no use recorded. Every other buffer is allocated and written on the copy
  stream. The result reaches the consumer's stream through FastLoader's event and
  ``record_stream``.
- torchvision's decoder waits on the host for its private stream (twice a batch at least), so
  :class:`DecodeCrops` says it ``blocks_host``: FastLoader then runs it, with the copy, in a
  helper thread, and the training thread goes on queueing its own work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from fastfeed._torch_compat import default_collate
from fastfeed.vision.resample import FIELDS, UINT8, PixelAffine, resize_crops

__all__ = ["DecodeCrops", "EncodedCrop", "JpegDecoder", "NvjpegDecoder", "collate_crops",
           "encoded_collate", "gpu_decodable"]

# Start-of-frame markers nvJPEG decodes: baseline, extended and progressive Huffman.
_NVJPEG_FRAMES = (0xC0, 0xC1, 0xC2)
# Markers without a length field: TEM, the restart markers, SOI and EOI.
_STANDALONE = {0x01, *range(0xD0, 0xDA)}


def _frame_header(data: bytes) -> tuple[int, int, int] | None:
    """``(marker, sample precision, components)`` of a JPEG's start of frame, None if none."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # a fill byte
            i += 1
        elif marker in _STANDALONE:
            i += 2
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return (marker, data[i + 4], data[i + 9]) if i + 9 < len(data) else None
        else:
            i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return None


def gpu_decodable(data: bytes) -> bool:
    """Whether nvJPEG decodes ``data`` as the CPU would: an 8-bit greyscale or YCbCr JPEG
    (Huffman-coded) that ends with its end-of-image marker."""
    if data[:2] != b"\xff\xd8" or not data[-64:].rstrip(b"\x00").endswith(b"\xff\xd9"):
        return False
    header = _frame_header(data)
    return (header is not None and header[0] in _NVJPEG_FRAMES and header[1] == 8
            and header[2] in (1, 3))


@dataclass
class EncodedCrop:
    """One sample for the GPU: a file's bytes and the crop to make of it, or the crop decoded
    by the worker.

    Attributes:
        geometry: the crop (:func:`fastfeed.vision.resample.crop_geometry`); for ``pixels``,
            the whole of them (a flip there still applies).
        data: the encoded file (writable uint8), for the GPU to decode.
        pixels: uint8 ``3×H×W``, decoded by the worker (a file nvJPEG cannot take).
    """

    geometry: np.ndarray
    data: np.ndarray | None = None
    pixels: torch.Tensor | None = None


def encoded_array(data: bytes) -> np.ndarray:
    """The file as a writable uint8 array (torch warns on a read-only one)."""
    return np.frombuffer(data, dtype=np.uint8).copy()


def collate_crops(crops: list[EncodedCrop]) -> dict[str, Any]:
    """A batch of crops: ``encoded`` (the files, numpy arrays: they stay on the host),
    ``pixels`` (the worker-decoded crops, one uint8 tensor: it crosses to the device),
    ``geometry`` (one row a sample, numpy) and ``order`` (for each sample, its index in
    ``encoded``, or ``-1 - `` its index in ``pixels``)."""
    decoded = np.array([c.pixels is not None for c in crops])
    geometry = np.stack([c.geometry for c in crops])
    out_w, out_h = (int(geometry[0, FIELDS.index(f)]) for f in ("out_w", "out_h"))
    pixels = [c.pixels for c in crops if c.pixels is not None]
    return {
        "encoded": [c.data for c in crops if c.pixels is None],
        "pixels": torch.stack(pixels) if pixels else torch.empty((0, 3, out_h, out_w),
                                                                 dtype=torch.uint8),
        "geometry": geometry,
        "order": np.where(decoded, -np.cumsum(decoded), np.cumsum(~decoded) - 1),
    }


def encoded_collate(samples: list[tuple[Any, ...]]) -> list[Any]:
    """``[(EncodedCrop, target, ...), ...]`` -> ``[collate_crops(...), targets, ...]``: the
    rest as ``default_collate`` collates it."""
    columns = list(zip(*samples, strict=True))
    return [collate_crops(list(columns[0])), *(default_collate(list(c)) for c in columns[1:])]


class JpegDecoder(Protocol):
    """Decodes JPEG files to RGB on a device: ``3×H×W`` uint8 tensors, contiguous, safe to
    use on the caller's current stream, in the order given."""

    def __call__(self, encoded: list[torch.Tensor], device: torch.device
                 ) -> list[torch.Tensor]: ...


class NvjpegDecoder:
    """:class:`JpegDecoder` by ``torchvision.io.decode_jpeg(device=...)`` (nvJPEG; its
    hardware backend on A100/H100 for the files it accepts), following the stream rules of
    the module's notes. On a CPU device, torchvision's CPU decoder."""

    def __init__(self) -> None:
        self._decode_stream: Any = None  # made on first use, per process

    def __getstate__(self) -> dict[str, Any]:
        return {"_decode_stream": None}

    def __call__(self, encoded: list[torch.Tensor], device: torch.device
                 ) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg  # optional: needed only here

        if not encoded:
            return []
        if device.type != "cuda":
            return decode_jpeg(encoded, device=device, mode=ImageReadMode.RGB)
        if self._decode_stream is None:
            self._decode_stream = torch.cuda.Stream(device)
        caller = torch.cuda.current_stream(device)
        with torch.cuda.stream(self._decode_stream):
            images = decode_jpeg(encoded, device=device, mode=ImageReadMode.RGB)
        caller.wait_stream(self._decode_stream)
        for image in images:
            image.record_stream(caller)
        return images


class DecodeCrops:
    """The device stage of a batch of crops: ``[collate_crops(...), rest...]`` ->
    ``[images, rest...]`` (the container's type kept), ``images`` an ``N×3×H×W`` batch as
    ``affine`` says (rounded uint8 by default).

    Args:
        affine: the conversion and normalisation folded into the resize.
        decoder: decodes the files (default: :class:`NvjpegDecoder`).
        needs_cuda: if given, the message of the error raised for a batch that is not on a
            CUDA device.
    """

    # torchvision's decoder waits on the host for its own stream: FastLoader runs this in a
    # helper thread (see fastfeed.device.DeviceIterator).
    blocks_host = True

    def __init__(self, affine: PixelAffine = UINT8, decoder: JpegDecoder | None = None,
                 needs_cuda: str | None = None) -> None:
        self.affine = affine
        self.decoder: JpegDecoder = decoder if decoder is not None else NvjpegDecoder()
        self.needs_cuda = needs_cuda

    def images(self, crops: dict[str, Any]) -> torch.Tensor:
        """The batch's images, on the device of ``crops["pixels"]``."""
        pixels: torch.Tensor = crops["pixels"]
        decoded = self.decoder([torch.from_numpy(data) for data in crops["encoded"]],
                               pixels.device)
        rows = pixels.unbind(0)
        images = [decoded[i] if i >= 0 else rows[-1 - i] for i in crops["order"].tolist()]
        return resize_crops(images, crops["geometry"], self.affine)

    def __call__(self, batch: Any) -> Any:
        crops, *rest = batch
        if self.needs_cuda is not None and crops["pixels"].device.type != "cuda":
            raise RuntimeError(self.needs_cuda)
        return type(batch)([self.images(crops), *rest])

