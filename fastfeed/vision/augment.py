"""Random-resized-crop, flip and letterbox geometry, drawn from torch's RNG.

The random draws come from torch's global generator, which FastLoader seeds per worker as
torch does (or per sample with ``deterministic=True``), so augmentations are reproducible.
"""

from __future__ import annotations

import math

import torch

from fastfeed.vision.window_decode import Box

__all__ = ["center_crop_box", "letterbox_geometry", "random_flip", "random_resized_crop_box"]


def random_resized_crop_box(
    width: int,
    height: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    attempts: int = 10,
) -> Box:
    """A random box covering ``scale`` of the area with aspect in ``ratio`` (log-uniform).

    After ``attempts`` misses, falls back to the largest central box within ``ratio``.
    """
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(attempts):
        target = area * float(torch.empty(1).uniform_(scale[0], scale[1]))
        aspect = math.exp(float(torch.empty(1).uniform_(log_lo, log_hi)))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            y = int(torch.randint(0, height - h + 1, (1,)))
            x = int(torch.randint(0, width - w + 1, (1,)))
            return x, y, w, h
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def center_crop_box(width: int, height: int, crop_fraction: float = 0.875) -> Box:
    """The evaluation crop: the central square of ``crop_fraction`` of the short side."""
    side = max(1, round(min(width, height) * crop_fraction))
    return (width - side) // 2, (height - side) // 2, side, side


def random_flip(p: float = 0.5) -> bool:
    """Whether to flip this sample (one draw from torch's RNG)."""
    return float(torch.rand(())) < p


def letterbox_geometry(width: int, height: int, size: int) -> tuple[float, int, int, int, int]:
    """Fit ``width × height`` into ``size × size`` keeping aspect, centred (Ultralytics style).

    Returns ``(ratio, new_width, new_height, pad_left, pad_top)``.
    """
    ratio = min(size / width, size / height)
    new_w, new_h = max(1, round(width * ratio)), max(1, round(height * ratio))
    return ratio, new_w, new_h, (size - new_w) // 2, (size - new_h) // 2
