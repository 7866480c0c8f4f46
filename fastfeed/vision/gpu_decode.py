"""Batches of JPEG files decoded on the GPU, then cropped, resized, flipped and normalised there:
what the ``"nvjpeg"`` backend and ``accelerate(..., decode_device="cuda")`` share.

Workers read each file, parse only its header (the crop window is drawn from the image size)
and hand over an :class:`EncodedCrop`: the encoded bytes and the window, or, for a file nvJPEG
cannot take (see :func:`gpu_decodable`: ImageNet has a PNG named ``.JPEG`` and CMYK JPEGs),
the crop decoded by the worker on the CPU. :func:`collate_crops` makes one batch of them (the
bytes as numpy arrays, which device prefetch leaves on the host; the geometry as one array of
host numbers). On the copy stream, :class:`DecodeCrops` decodes the batch's files with one call
to a :class:`~fastfeed.vision.jpeg_decoders.JpegDecoder` (TorchCodec's or torchvision's nvJPEG
decode, chosen by :func:`~fastfeed.vision.jpeg_decoders.jpeg_decoder`), then resizes the
whole batch with :func:`fastfeed.vision.resample.resize_crops`: a few kernels per group of
similar crops, however many images. A file the decoder still refuses (the whole call fails)
is decoded on the host, in the helper thread, and joins its batch there.

Four rules keep the decode from stalling the training thread, racing the copy stream or
hiding a failure:

- Nothing reads a device value back (``.tolist()``, ``.item()``, ``.cpu()``, ``if tensor``):
  that would make the host wait for every kernel queued on the GPU. The windows and the image
  sizes are what the host needs, so they stay on the host, and the tables built from them cross
  to the device in one asynchronous copy.
- No buffer is written by a stream that does not wait for the buffer's previous users. The
  decoders allocate their outputs on the caller's current stream, and torchvision's writes
  them on a stream of its own that waits for nothing. On the copy stream, that could hand the
  decoder a block the caching allocator just freed there, while kernels queued on the copy
  stream still read it. So the decode runs with fastfeed's decode stream as the current one
  (one per process and device, none of torch's pool: :mod:`fastfeed.device.own_streams`), on
  which no kernel of ours ever runs: its blocks are freed only once the copy stream's recorded
  uses complete (``record_stream``), and the copy stream waits for it before touching the
  images. Outputs are asked for in RGB (torchvision's ``UNCHANGED`` mode clones a greyscale
  image on the current stream and frees the original unrecorded). Every other buffer is
  allocated and written on the copy stream. The result reaches the consumer's stream through
  FastLoader's event and ``record_stream``.
- The decoders wait on the host for their stream (once or twice a batch), so
  :class:`DecodeCrops` says it ``blocks_host``: FastLoader then runs it, with the copy, in a
  helper thread, and the training thread goes on queueing its own work.
- Only a file's own fault is taken for a refusal. Out of device memory is no file's: where
  nvJPEG's own ``cudaMalloc`` failed, the batch is decoded once more after torch's cached,
  unused memory is released, unless a CUDA graph is being captured, and the retry is counted
  and logged (:mod:`fastfeed.vision.decode_retry`); a second failure is raised. A decode stream
  that cannot be made, or a CUDA error, is raised at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from fastfeed._torch_compat import default_collate
from fastfeed.device import pinned_source
from fastfeed.vision.decode_retry import MemoryRetries
from fastfeed.vision.jpeg_decoders import (
    DecoderOutOfMemory,
    DecoderRefused,
    JpegDecoder,
    jpeg_decoder,
)
from fastfeed.vision.resample import FIELDS, UINT8, PixelAffine, crop_geometry, resize_crops
from fastfeed.vision.window_decode import (
    FRAME_MARKERS,
    DecodeError,
    decode_resized_crop,
    image_size,
    jpeg_ends,
)

__all__ = ["DecodeCrops", "EncodedCrop", "collate_crops", "encoded_collate", "gpu_decodable"]

logger = logging.getLogger(__name__)

# Start-of-frame markers nvJPEG decodes: baseline, extended and progressive Huffman.
_NVJPEG_FRAMES = (0xC0, 0xC1, 0xC2)
# Markers without a length field: TEM, the restart markers, SOI and EOI.
_STANDALONE = {0x01, *range(0xD0, 0xDA)}
_APP0, _APP1, _APP14, _SOS = 0xE0, 0xE1, 0xEE, 0xDA
_EXIF_ORIENTATION = 0x0112
# The luma sampling factors (H, V) of 4:4:4, 4:2:2, 4:2:0 and 4:4:0, with chroma at 1x1.
_NVJPEG_SAMPLING = {(1, 1), (2, 1), (2, 2), (1, 2)}


@dataclass
class _Header:
    """What a JPEG's markers up to its first scan say about how it is decoded."""

    frame: int = 0  # the start-of-frame marker; 0 if none
    precision: int = 0
    components: tuple[tuple[int, int, int], ...] = ()  # (id, H, V) each
    jfif: bool = False
    adobe_transform: int | None = None
    orientation: int = 1  # EXIF's; 1: as stored


def _header(data: bytes) -> _Header:
    header, i = _Header(), 2
    while i + 4 <= len(data) and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF:  # a fill byte
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        if marker == _SOS:
            break
        end = i + 2 + int.from_bytes(data[i + 2 : i + 4], "big")
        body = (data[i + 4 : end] if marker in FRAME_MARKERS or marker in (_APP0, _APP1, _APP14)
                else b"")
        if marker == _APP0 and body.startswith(b"JFIF\0"):
            header.jfif = True
        elif marker == _APP1 and body.startswith(b"Exif\0\0"):
            header.orientation = _exif_orientation(body[6:])
        elif marker == _APP14 and body.startswith(b"Adobe") and len(body) >= 12:
            header.adobe_transform = body[11]
        elif marker in FRAME_MARKERS and len(body) >= 6:
            header.frame, header.precision = marker, body[0]
            header.components = tuple((body[j], body[j + 1] >> 4, body[j + 1] & 15)
                                      for j in range(6, min(len(body) - 1, 6 + 3 * body[5]), 3))
        i = end
    return header


def _exif_orientation(tiff: bytes) -> int:
    """The orientation tag of an EXIF block's first directory (1 where there is none)."""
    order: Literal["little", "big"] = "little" if tiff[:2] == b"II" else "big"
    at = int.from_bytes(tiff[4:8], order)
    count = int.from_bytes(tiff[at:at + 2], order)
    for entry in range(at + 2, min(at + 2 + 12 * count, len(tiff) - 11), 12):
        if int.from_bytes(tiff[entry:entry + 2], order) == _EXIF_ORIENTATION:
            return int.from_bytes(tiff[entry + 8:entry + 10], order)
    return 1


def _stored_as_rgb(header: _Header) -> bool:
    """Whether libjpeg reads the three components as RGB, not YCbCr: no JFIF marker, and an
    Adobe marker with transform 0 or, without one, the component ids 'R', 'G', 'B'."""
    if header.jfif or len(header.components) != 3:
        return False
    if header.adobe_transform is not None:
        return header.adobe_transform == 0
    return tuple(c[0] for c in header.components) == (82, 71, 66)


def gpu_decodable(data: bytes) -> bool:
    """Whether nvJPEG decodes ``data`` as the CPU would: an 8-bit, Huffman-coded JPEG that ends
    with its end-of-image marker, greyscale or YCbCr in 4:4:4, 4:2:2, 4:2:0 or 4:4:0.

    Any other sampling (torchvision refuses what nvJPEG calls unknown, failing the batch; the
    rest are rare), a JPEG that libjpeg reads as RGB (an Adobe marker's transform 0: no
    decoder documents whether nvJPEG honours it, and a mistake would be silent, in the
    colours) and one whose EXIF orientation turns it (TorchCodec's GPU decode applies it, as
    Pillow and torchvision do not: the image, and the window drawn for it, would turn) are
    the CPU's."""
    if not jpeg_ends(data):
        return False
    header = _header(data)
    if header.frame not in _NVJPEG_FRAMES or header.precision != 8 or header.orientation > 1:
        return False
    if len(header.components) == 1:
        return True
    return (len(header.components) == 3 and not _stored_as_rgb(header)
            and all(c[1:] == (1, 1) for c in header.components[1:])
            and header.components[0][1:] in _NVJPEG_SAMPLING)


@dataclass
class EncodedCrop:
    """One sample for the GPU: a file's bytes and the crop to make of it, or the crop decoded
    by the worker.

    Attributes:
        geometry: the crop (:func:`fastfeed.vision.resample.crop_geometry`); for ``pixels``,
            the whole of them (a flip there still applies).
        data: the encoded file (uint8), for the GPU to decode.
        pixels: uint8 ``3×H×W``, decoded by the worker (a file nvJPEG cannot take).
        path: the file's name, for errors.
    """

    geometry: np.ndarray
    data: np.ndarray | None = None
    pixels: torch.Tensor | None = None
    path: str = "<bytes>"

    @classmethod
    def encoded(cls, data: bytes, geometry: np.ndarray, path: str) -> EncodedCrop:
        """A file for the GPU, as the bytes read (no copy: the slot pool copies them anyway)."""
        return cls(geometry, data=np.frombuffer(data, dtype=np.uint8), path=path)

    @classmethod
    def decoded(cls, pixels: torch.Tensor) -> EncodedCrop:
        """A crop the worker made: ``pixels`` whole."""
        size = (pixels.shape[2], pixels.shape[1])
        return cls(crop_geometry((0, 0, *size), size), pixels=pixels)


def collate_crops(crops: list[EncodedCrop]) -> dict[str, Any]:
    """A batch of crops: ``encoded`` (the files, numpy arrays: they stay on the host) and
    ``paths`` (their names), ``pixels`` (the worker-decoded crops, one uint8 tensor: it
    crosses to the device), ``geometry`` (one row a sample, numpy) and ``order`` (for each
    sample, its index in ``encoded``, or ``-1 - `` its index in ``pixels``)."""
    decoded = np.array([c.pixels is not None for c in crops])
    geometry = np.stack([c.geometry for c in crops])
    out_w, out_h = (int(geometry[0, FIELDS.index(f)]) for f in ("out_w", "out_h"))
    pixels = [c.pixels for c in crops if c.pixels is not None]
    return {
        "encoded": [c.data for c in crops if c.pixels is None],
        "paths": [c.path for c in crops if c.pixels is None],
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


def _decoded_on_host(data: np.ndarray, path: str, refused: Exception) -> torch.Tensor:
    """A file the GPU's decoder refused, decoded whole the workers' way: uint8 ``3×H×W``."""
    encoded = data.tobytes()
    try:
        size = image_size(encoded, path)
        return decode_resized_crop(encoded, lambda width, height: (0, 0, width, height), size,
                                   path)
    except DecodeError as error:
        raise DecodeError(f"{error}; the GPU's decoder refused it too ({refused}). (on_error "
                          "does not apply: the file's batch was already collated)") from refused


class DecodeCrops:
    """The device stage of a batch of crops: ``[collate_crops(...), rest...]`` ->
    ``[images, rest...]`` (the container's type kept), ``images`` an ``N×3×H×W`` batch as
    ``affine`` says (rounded uint8 by default).

    The decoder takes the batch's files in one call. If it refuses them, it is given one file
    at a time, and each file it refuses is decoded on the host, as the workers decode, and
    copied to the device to join the batch; a file neither decodes raises
    :class:`~fastfeed.vision.window_decode.DecodeError`, naming it. Out of device memory, the
    call may be made once more after torch's cached memory is released (see the module's
    notes; :attr:`memory_retries` counts those).

    Args:
        affine: the conversion and normalisation folded into the resize.
        decoder: decodes the files: a :class:`~fastfeed.vision.jpeg_decoders.JpegDecoder`, or
            the name of one (:data:`~fastfeed.vision.jpeg_decoders.DECODERS`); default
            ``FASTFEED_JPEG_DECODER``, else TorchCodec where it imports, else torchvision.
            A name is resolved at the first batch.
        needs_cuda: if given, the message of the error raised for a batch that is not on a
            CUDA device.
    """

    # The decoders wait on the host for their stream: FastLoader runs this in a helper thread
    # (see fastfeed.device.DeviceIterator).
    blocks_host = True

    def __init__(self, affine: PixelAffine = UINT8, decoder: JpegDecoder | str | None = None,
                 needs_cuda: str | None = None) -> None:
        self.affine = affine
        self.decoder = decoder
        self.needs_cuda = needs_cuda
        self._retries = MemoryRetries()

    @property
    def memory_retries(self) -> int:
        """The batches decoded again after torch's cache was released for nvJPEG."""
        return self._retries.count

    def _decoded(self, files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """The decoder's images; out of nvJPEG's memory, maybe once more (see the module's
        notes)."""
        if self.decoder is None or isinstance(self.decoder, str):
            self.decoder = jpeg_decoder(self.decoder)
        try:
            return self.decoder(files, device)
        except DecoderOutOfMemory as error:
            self._retries.release_for(error)
        return self.decoder(files, device)

    def decode(self, encoded: list[np.ndarray], paths: list[str], device: torch.device
               ) -> list[torch.Tensor]:
        """The files decoded on ``device``, in order; those the decoder refuses, on the
        host."""
        # torch warns on a read-only array: the bytes as a worker read them (thread workers,
        # the dataset read directly) are; a pool slot is not
        files = [torch.from_numpy(data if data.flags.writeable else data.copy())
                 for data in encoded]
        try:
            return self._decoded(files, device)
        except DecoderRefused:
            pass  # one of them, at least: each alone
        images, refused = [], []
        for file, path in zip(files, paths, strict=True):
            try:
                images.append(self._decoded([file], device)[0])
            except DecoderRefused as error:
                image = _decoded_on_host(file.numpy(), path, error)
                refused.append(f"{path} ({error})")
                # from page-locked memory, asynchronously, on the current (copy) stream
                images.append(pinned_source(image).to(device, non_blocking=True)
                              if device.type == "cuda" else image)
        if refused:
            logger.warning("the GPU's JPEG decoder refused %d file(s) of a batch, decoded on "
                           "the host instead: %s%s", len(refused), "; ".join(refused[:5]),
                           f"; and {len(refused) - 5} more" if len(refused) > 5 else "")
        return images

    def images(self, crops: dict[str, Any]) -> torch.Tensor:
        """The batch's images, on the device of ``crops["pixels"]``."""
        pixels: torch.Tensor = crops["pixels"]
        decoded = self.decode(crops["encoded"], crops["paths"], pixels.device)
        rows = pixels.unbind(0)
        images = [decoded[i] if i >= 0 else rows[-1 - i] for i in crops["order"].tolist()]
        return resize_crops(images, crops["geometry"], self.affine)

    def __call__(self, batch: Any) -> Any:
        crops, *rest = batch
        if self.needs_cuda is not None and crops["pixels"].device.type != "cuda":
            raise RuntimeError(self.needs_cuda)
        return type(batch)([self.images(crops), *rest])
