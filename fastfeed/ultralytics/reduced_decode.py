"""Ultralytics' ``BaseDataset.load_image``, decoding large JPEGs at a reduced DCT scale.

Ultralytics decodes every image at full size, then shrinks its long side to ``imgsz`` with
``cv2.resize`` (bilinear). An image at least twice ``imgsz`` can be decoded by libjpeg straight
at 1/2, 1/4 or 1/8 scale (OpenCV's ``IMREAD_REDUCED_COLOR_*``), which skips most of the inverse
DCT and colour conversion and leaves the resize a smaller image to read. The shrink to
Ultralytics' output size then samples where ``cv2.resize`` samples, with float weights
(:func:`~fastfeed.ultralytics.warp.shrink_linear`, within one grey level of ``cv2.resize``, in
three quarters of its time); pixels differ from Ultralytics' by the DCT scaling, a little
smoother than the full-size decode's bilinear shrink (see ``docs/ultralytics.md`` for the
measured difference).

JPEGs under twice ``imgsz`` are decoded at full scale, exactly as Ultralytics decodes them.
Everything else takes Ultralytics' own path: images in RAM, ``.npy`` caches, other formats,
grey-scale datasets, and the short-side and stretch modes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import cv2
import numpy as np

from fastfeed.ultralytics.warp import shrink_linear
from fastfeed.vision.window_decode import DecodeError, image_size

__all__ = ["dct_scale", "reduced_load_image", "target_size"]

_FLAGS = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
          8: cv2.IMREAD_REDUCED_COLOR_8}
_JPEG_SUFFIXES = (".jpg", ".jpeg")

LoadImage = Callable[..., tuple[np.ndarray, tuple[int, int], tuple[int, int]]]


def target_size(height: int, width: int, imgsz: int) -> tuple[int, int]:
    """``(width, height)`` after Ultralytics scales the long side to ``imgsz``."""
    r = imgsz / max(height, width)
    return min(math.ceil(width * r), imgsz), min(math.ceil(height * r), imgsz)


def dct_scale(height: int, width: int, size: tuple[int, int]) -> int:
    """The coarsest libjpeg scale denominator whose decode still covers ``size``: 8, 4, 2 or 1."""
    for denominator in (8, 4, 2):
        if (math.ceil(width / denominator) >= size[0]
                and math.ceil(height / denominator) >= size[1]):
            return denominator
    return 1


def _takes_fast_path(dataset: Any, i: int, rect_mode: bool, resize_short: bool) -> bool:
    return (dataset.ims[i] is None and rect_mode and not resize_short
            and dataset.cv2_flag == cv2.IMREAD_COLOR
            and str(dataset.im_files[i]).lower().endswith(_JPEG_SUFFIXES)
            and dataset.cache != "disk" and not os.path.exists(dataset.npy_files[i]))


def _decode(path: str, imgsz: int) -> tuple[np.ndarray, tuple[int, int]] | None:
    """The image resized as Ultralytics resizes it, and its full ``(h, w)``; ``None`` for a
    file that is not what its header says (Ultralytics' own reader then reports it)."""
    with open(path, "rb") as file:  # pathlib's wrappers cost a tenth of the read
        data = file.read()
    try:
        width, height = image_size(data, path)
    except DecodeError:
        return None
    denominator = dct_scale(height, width, target_size(height, width, imgsz))
    # At full scale this is exactly Ultralytics' imread of a JPEG, without reading it twice.
    image = cv2.imdecode(np.frombuffer(data, np.uint8), _FLAGS[denominator])
    if image is None:
        return None
    decoded = image.shape[:2]
    if decoded == (math.ceil(width / denominator), math.ceil(height / denominator)):
        height, width = width, height  # OpenCV applied an EXIF rotation of 90 or 270 degrees
    elif decoded != (math.ceil(height / denominator), math.ceil(width / denominator)):
        return None
    if max(height, width) != imgsz:  # Ultralytics resizes whenever the ratio is not 1
        size = target_size(height, width, imgsz)
        # A full-scale decode keeps Ultralytics' bytes, so its resize does too.
        shrunk = shrink_linear(image, size) if denominator > 1 else None
        image = cv2.resize(image, size, interpolation=cv2.INTER_LINEAR) if shrunk is None \
            else shrunk
    return image, (height, width)


def reduced_load_image(original: LoadImage) -> LoadImage:
    """Wrap ``BaseDataset.load_image`` (``original``) with the reduced-scale decode."""

    def load_image(self: Any, i: int, rect_mode: bool = True, resize_short: bool = False
                   ) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
        if not _takes_fast_path(self, i, rect_mode, resize_short):
            return original(self, i, rect_mode, resize_short)
        imgsz = max(self.imgsz) if isinstance(self.imgsz, (tuple, list)) else self.imgsz
        decoded = _decode(str(self.im_files[i]), imgsz)
        if decoded is None:
            return original(self, i, rect_mode, resize_short)
        image, original_hw = decoded
        # Ultralytics' mosaic buffer, kept exactly as its load_image keeps it.
        if self.augment and self.cache != "ram":
            self.ims[i], self.im_hw0[i], self.im_hw[i] = image, original_hw, image.shape[:2]
            self.buffer.append(i)
            if 1 < len(self.buffer) >= self.max_buffer_length:
                j = self.buffer.pop(0)
                self.ims[j], self.im_hw0[j], self.im_hw[j] = None, None, None
        return image, original_hw, image.shape[:2]

    load_image.__wrapped__ = original  # type: ignore[attr-defined]
    return load_image
