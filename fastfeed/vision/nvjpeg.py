"""The ``"nvjpeg"`` backend: workers read file bytes; the GPU decodes, crops and resizes.

Workers parse only the JPEG header (to draw the crop box from the image size) and hand over
the encoded bytes as numpy arrays, which device prefetch leaves on the host. On the copy
stream, :class:`NvjpegDecode` decodes the whole batch with
``torchvision.io.decode_jpeg(device="cuda")`` and crops, resizes and flips each image on the
GPU. torchvision is imported only here, and only when this backend is used.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fastfeed.vision.augment import random_flip
from fastfeed.vision.decode import image_size
from fastfeed.vision.folder import ImageFolder

__all__ = ["EncodedImageFolder", "NvjpegDecode", "encoded_collate"]


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
        "box": torch.tensor([s["box"] for s in samples], dtype=torch.int64),
        "flip": torch.tensor([s["flip"] for s in samples], dtype=torch.bool),
        "target": torch.tensor([s["target"] for s in samples], dtype=torch.int64),
    }


class NvjpegDecode:
    """gpu_transform: ``{"data", "box", "flip", "target"}`` -> ``(uint8 N×3×S×S, targets)``."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        from torchvision.io import decode_jpeg  # optional dependency, needed only here

        device = batch["target"].device
        encoded = [torch.from_numpy(np.asarray(d)) for d in batch["data"]]
        images = decode_jpeg(encoded, device=device)
        out = torch.empty((len(images), 3, self.size, self.size), dtype=torch.uint8,
                          device=device)
        for i, (image, (x, y, w, h)) in enumerate(zip(images, batch["box"].tolist(),
                                                      strict=True)):
            crop = image[:3, y:y + h, x:x + w].unsqueeze(0).float()
            if crop.shape[1] == 1:
                crop = crop.expand(-1, 3, -1, -1)
            resized = torch.nn.functional.interpolate(crop, size=(self.size, self.size),
                                                      mode="bilinear", antialias=True,
                                                      align_corners=False)
            out[i] = resized[0].round_().clamp_(0, 255).to(torch.uint8)
        flip = batch["flip"].view(-1, 1, 1, 1)
        return torch.where(flip, out.flip(-1), out), batch["target"]
