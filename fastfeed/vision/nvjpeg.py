"""The ``"nvjpeg"`` backend: workers read file bytes; the GPU decodes, crops and resizes.

Workers parse only the JPEG header (to draw the crop box from the image size) and hand over
the encoded bytes as numpy arrays and the boxes as Python ints, which device prefetch leaves on
the host. On the copy stream, :class:`NvjpegDecode` decodes the whole batch with
``torchvision.io.decode_jpeg(device="cuda")``, crops and resizes each image on the GPU, then
rounds and flips the batch at once. torchvision is imported only here, and only when this
backend is used.

Two rules keep the copy stream from stalling the training thread or racing it:

- Nothing reads a device value back (``.tolist()``, ``.item()``, ``.cpu()``, ``if tensor``):
  that would make the host wait for every kernel queued on the GPU. The crop boxes are what
  the host needs, so they never go to the device.
- No buffer is written by a stream that does not wait for the buffer's previous users.
  torchvision's decoder allocates its outputs on the caller's current stream but writes them
  on a private stream that waits for nothing, then makes the caller wait for it. On the copy
  stream, that could hand the decoder a block the caching allocator just freed there, while
  kernels queued on the copy stream still read it. So the decode runs with a stream of our
  own as the current one, on which no kernel ever runs: it first waits for the copy stream,
  its blocks are freed only once the copy stream's recorded uses complete
  (``record_stream``), and the copy stream waits for it before touching the images. Every
  other buffer is allocated and written on the copy stream. The result reaches the
  consumer's stream through FastLoader's event and ``record_stream``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fastfeed.vision.augment import random_flip
from fastfeed.vision.decode import image_size
from fastfeed.vision.folder import ImageFolder

__all__ = ["EncodedImageFolder", "NvjpegDecode", "crop_resize", "encoded_collate"]


class EncodedImageFolder(ImageFolder):
    """An :class:`ImageFolder` whose items are the encoded file plus the crop to apply."""

    def __getitem__(self, index: int) -> Any:
        path, target = self.samples[index]
        with open(path, "rb") as f:
            data = f.read()
        box = self._box(*image_size(data, path))
        flip = self.train and random_flip()
        return {"data": np.frombuffer(data, dtype=np.uint8), "box": box, "flip": flip,
                "target": target}


def encoded_collate(samples: list[dict]) -> dict[str, Any]:
    return {
        "data": [s["data"] for s in samples],
        # Python ints, not a tensor: FastLoader would move a tensor to the GPU, and the host
        # would then wait for the GPU to read the boxes back.
        "box": [tuple(s["box"]) for s in samples],
        "flip": torch.tensor([s["flip"] for s in samples], dtype=torch.bool),
        "target": torch.tensor([s["target"] for s in samples], dtype=torch.int64),
    }


def crop_resize(images: Sequence[torch.Tensor], boxes: Sequence[Sequence[int]], size: int
                ) -> torch.Tensor:
    """Crop each ``C×H×W`` uint8 image to its ``(x, y, w, h)`` box and resize it (bilinear,
    antialiased) into one float32 ``N×3×size×size`` batch, unrounded.

    The crops differ in size, so one interpolation per image; its output goes straight into
    the batch, and rounding happens once for the whole batch, in the caller: three kernels an
    image (convert, resize, store) instead of six.
    """
    out = torch.empty((len(images), 3, size, size), dtype=torch.float32,
                      device=images[0].device if images else None)
    for i, (image, (x, y, w, h)) in enumerate(zip(images, boxes, strict=True)):
        crop = image[:3, y:y + h, x:x + w].unsqueeze(0).float()
        if crop.shape[1] == 1:  # greyscale JPEG
            crop = crop.expand(-1, 3, -1, -1)
        out[i:i + 1] = torch.nn.functional.interpolate(
            crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return out


class NvjpegDecode:
    """gpu_transform: ``{"data", "box", "flip", "target"}`` -> ``(uint8 N×3×S×S, targets)``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._decode_stream: Any = None  # made on first use, per process

    def __getstate__(self) -> dict[str, Any]:
        return {"size": self.size, "_decode_stream": None}

    def decode(self, encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """``torchvision.io.decode_jpeg`` on ``device``, its outputs safe to use on the
        caller's current stream (see the module's notes)."""
        from torchvision.io import decode_jpeg  # optional dependency, needed only here

        if device.type != "cuda":
            return decode_jpeg(encoded, device=device)
        if self._decode_stream is None:
            self._decode_stream = torch.cuda.Stream(device)
        caller = torch.cuda.current_stream(device)
        self._decode_stream.wait_stream(caller)
        with torch.cuda.stream(self._decode_stream):
            images = decode_jpeg(encoded, device=device)
        caller.wait_stream(self._decode_stream)
        for image in images:
            image.record_stream(caller)
        return images

    def __call__(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        encoded = [torch.from_numpy(np.asarray(d)) for d in batch["data"]]
        images = self.decode(encoded, batch["target"].device)
        out = crop_resize(images, batch["box"], self.size).round_().clamp_(0, 255)
        out = out.to(torch.uint8)
        flip = batch["flip"].view(-1, 1, 1, 1)
        return torch.where(flip, out.flip(-1), out), batch["target"]
