"""The ``"nvjpeg"`` backend: workers read file bytes; the GPU decodes, crops and resizes.

Workers parse only the JPEG header (to draw the crop box from the image size) and hand over
the encoded bytes as numpy arrays and the boxes as Python ints, which device prefetch leaves on
the host. On the copy stream, :class:`NvjpegDecode` decodes the whole batch with
``torchvision.io.decode_jpeg(device="cuda")``, crops and resizes each image on the GPU, then
rounds and flips the batch at once. torchvision is imported only here, and only when this
backend is used. A file nvJPEG cannot take (not a JPEG, though named ``.JPEG``: ImageNet has a
PNG; a CMYK, 12-bit, arithmetic-coded or truncated JPEG) is decoded by its worker on the CPU,
as :class:`~fastfeed.vision.ImageFolder` decodes it, so ``on_error`` applies to it alike.

Three rules keep the decode from stalling the training thread or racing the copy stream:

- Nothing reads a device value back (``.tolist()``, ``.item()``, ``.cpu()``, ``if tensor``):
  that would make the host wait for every kernel queued on the GPU. The crop boxes are what
  the host needs, so they never go to the device.
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
  :class:`NvjpegDecode` says it ``blocks_host``: FastLoader then runs it, with the copy, in a
  helper thread, and the training thread goes on queueing its own work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fastfeed.skip import SKIP
from fastfeed.transforms import Compose
from fastfeed.vision.augment import random_flip
from fastfeed.vision.decode import DecodeError, decode_resized_crop, image_size
from fastfeed.vision.folder import ImageFolder

__all__ = ["EncodedImageFolder", "NvjpegDecode", "crop_resize", "encoded_collate",
           "gpu_decodable", "nvjpeg_transform"]

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


class EncodedImageFolder(ImageFolder):
    """An :class:`ImageFolder` whose items are the encoded file plus the crop to apply.

    ``data`` is the file's bytes (a uint8 array) for the GPU to decode, or, for a file nvJPEG
    cannot take (see :func:`gpu_decodable`), the crop decoded here (uint8 ``3×size×size``),
    with the same random draws. A file that neither can decode is handled as ``on_error``
    says.
    """

    def __getitem__(self, index: int) -> Any:
        path, target = self.samples[index]
        try:
            with open(path, "rb") as f:
                data = f.read()
            if gpu_decodable(data):
                box = self._box(*image_size(data, path))
                item: Any = np.frombuffer(data, dtype=np.uint8)
            else:
                item = decode_resized_crop(data, self._box, (self.size, self.size), path,
                                           self.roi_decode)
                box = (0, 0, self.size, self.size)
        except DecodeError:
            if self.on_error == "skip":
                return SKIP
            raise
        flip = self.train and random_flip()
        return {"data": item, "box": box, "flip": flip, "target": target}


def encoded_collate(samples: list[dict]) -> dict[str, Any]:
    return {
        "data": [s["data"] for s in samples],
        # Python ints, not a tensor: FastLoader would move a tensor to the GPU, and the host
        # would then wait for the GPU to read the boxes back.
        "box": [tuple(s["box"]) for s in samples],
        "flip": torch.tensor([s["flip"] for s in samples], dtype=torch.bool),
        "target": torch.tensor([s["target"] for s in samples], dtype=torch.int64),
    }


def _resize_into(out: torch.Tensor, row: int, image: torch.Tensor,
                 box: Sequence[int]) -> None:
    x, y, w, h = box
    crop = image[:, y:y + h, x:x + w].unsqueeze(0).float()
    out[row:row + 1] = torch.nn.functional.interpolate(
        crop, size=out.shape[-2:], mode="bilinear", antialias=True, align_corners=False)


def crop_resize(images: Sequence[torch.Tensor], boxes: Sequence[Sequence[int]], size: int
                ) -> torch.Tensor:
    """Crop each ``3×H×W`` uint8 image to its ``(x, y, w, h)`` box and resize it (bilinear,
    antialiased) into one float32 ``N×3×size×size`` batch, unrounded.

    The crops differ in size, so one interpolation per image; its output goes straight into
    the batch, and rounding happens once for the whole batch, in the caller: three kernels an
    image (convert, resize, store) instead of six.
    """
    out = torch.empty((len(images), 3, size, size), dtype=torch.float32,
                      device=images[0].device if images else None)
    for row, (image, box) in enumerate(zip(images, boxes, strict=True)):
        _resize_into(out, row, image, box)
    return out


class NvjpegDecode:
    """gpu_transform: ``{"data", "box", "flip", "target"}`` -> ``(uint8 N×3×S×S, targets)``."""

    # torchvision's decoder waits on the host for its own stream: FastLoader runs this in a
    # helper thread (see fastfeed.device.DeviceIterator).
    blocks_host = True

    def __init__(self, size: int) -> None:
        self.size = size
        self._decode_stream: Any = None  # made on first use, per process

    def __getstate__(self) -> dict[str, Any]:
        return {"size": self.size, "_decode_stream": None}

    def decode(self, encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """``torchvision.io.decode_jpeg`` to RGB on ``device``, its outputs safe to use on the
        caller's current stream (see the module's notes)."""
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

    def __call__(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        data, boxes, device = batch["data"], batch["box"], batch["target"].device
        # Files the workers decoded (those nvJPEG cannot take) arrive as device tensors.
        encoded = [row for row, item in enumerate(data) if isinstance(item, np.ndarray)]
        images = self.decode([torch.from_numpy(data[row]) for row in encoded], device)
        out = torch.empty((len(data), 3, self.size, self.size), dtype=torch.float32,
                          device=device)
        for row, image in zip(encoded, images, strict=True):
            _resize_into(out, row, image, boxes[row])
        for row, item in enumerate(data):
            if isinstance(item, torch.Tensor):
                out[row].copy_(item)
        out = out.round_().clamp_(0, 255).to(torch.uint8)
        flip = batch["flip"].view(-1, 1, 1, 1)
        return torch.where(flip, out.flip(-1), out), batch["target"]


class _DecodeThen(Compose):
    """:class:`NvjpegDecode` followed by the user's ``gpu_transform``."""

    blocks_host = True


def nvjpeg_transform(size: int, then: Callable[[Any], Any] | None = None
                     ) -> Callable[[Any], Any]:
    """The backend's ``gpu_transform``: the decode, then ``then`` if given."""
    decode = NvjpegDecode(size)
    return decode if then is None else _DecodeThen([decode, then])
