"""Ultralytics' random perspective warp, bit-identical to OpenCV's in a third of its time.

With Ultralytics' default hyperparameters (``degrees=0``, ``shear=0``, ``perspective=0``),
``RandomPerspective`` only scales and translates the mosaic canvas, and ``cv2.warpAffine``
then spends about a sixth of a worker's time on a general 2-D resampling (2.4 ms per sample
at imgsz 640 on one core, as Ultralytics runs OpenCV). For such a matrix,
``fastfeed._warp`` interpolates each needed source row once and blends rows after, with
OpenCV 5's float32 arithmetic step for step, so the output is OpenCV's to the bit (see
``csrc/axis_warp.cpp``).

Bit-identity is checked, not assumed: :func:`matches_opencv` warps a probe image with both
once per process, and any difference (an OpenCV 4 build, whose warp is fixed-point; another
CPU's code path) leaves every warp to OpenCV. So do rotations, shears, perspective, images
that are not 3-channel ``uint8`` and output widths that are not a multiple of 32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from fastfeed.ultralytics.mosaic import BORDER, pending_canvas

try:
    from fastfeed import _warp  # type: ignore[attr-defined]
except ImportError:  # installed without a C++ compiler: every warp stays OpenCV's
    _warp = None

__all__ = ["exact_warp", "matches_opencv", "shrink_linear", "warp_axis_aligned"]

# OpenCV computes the last (width mod its vector width) pixels of a row with scalar code
# whose rounding may differ; a multiple of 32 has no such tail on any of its builds.
_WIDTH_MULTIPLE = 32

ApplyImage = Callable[[Any, dict, dict], dict]


def warp_axis_aligned(image: np.ndarray, matrix: np.ndarray, size: tuple[int, int],
                      border: int = BORDER) -> np.ndarray:
    """``cv2.warpAffine(image, matrix[:2], size, borderValue=border)`` for a matrix without
    rotation or shear.

    Args:
        image (np.ndarray): ``H×W×3`` ``uint8``, channels contiguous (rows may be strided).
        matrix (np.ndarray): 2×3 or 3×3, with ``matrix[0, 1] == matrix[1, 0] == 0``.
        size (tuple[int, int]): the output ``(width, height)``.
        border (int): the value of every channel outside the image, 0 to 255.

    Raises:
        ValueError: the image, matrix or size is not one this kernel takes.
        RuntimeError: fastfeed was installed without its C++ extensions.
    """
    if _warp is None:
        raise RuntimeError("fastfeed._warp was not built (no C++ compiler at install time)")
    reason = _unsupported(image, matrix, size)
    if not 0 <= border <= 255 or int(border) != border:
        reason = f"the border must be a uint8 value, got {border}"
    if reason:
        raise ValueError(f"warp_axis_aligned: {reason}")
    return _run(image, matrix, size, int(border))


def shrink_linear(image: np.ndarray, size: tuple[int, int]) -> np.ndarray | None:
    """``image`` shrunk to ``size`` ``(width, height)`` by bilinear interpolation at the pixel
    centres ``cv2.resize(image, size, interpolation=cv2.INTER_LINEAR)`` samples, with the
    separable kernel's float32 weights where OpenCV's are 11-bit fixed point: within one grey
    level of it, in about three quarters of its time. ``None`` where the kernel cannot run it
    (not built, a CPU without AVX2 and FMA, not an ``H×W×3`` ``uint8`` image with contiguous
    pixels, or ``size`` larger than the image on either axis)."""
    height, width = image.shape[:2]
    if (_warp is None or not _warp.available() or _unsupported_image(image)
            or not (0 < size[0] <= width and 0 < size[1] <= height)):
        return None
    # cv2.resize reads output pixel x at source x' = (x + 0.5) * width / size - 0.5: the
    # inverse of x = a * x' + b below. A shrink reaches past the image's last pixel only by
    # float32 rounding (an image over about 5,800 pixels shrunk by one or two), where the
    # border's weight is under 1e-3: still within a grey level of cv2.resize.
    a, d = size[0] / width, size[1] / height
    matrix = np.array([[a, 0, 0.5 * a - 0.5], [0, d, 0.5 * d - 0.5]])
    return _run(image, matrix, size, BORDER)


def _run(image: np.ndarray, matrix: np.ndarray, size: tuple[int, int], border: int
         ) -> np.ndarray:
    """The kernel, on inputs :func:`_unsupported` accepted."""
    height, width = image.shape[:2]
    return _run_tiles([_tile(image, 0, 0)], (height, width), matrix, size, border)


def _tile(image: np.ndarray, y: int, x: int) -> tuple[int, int, int, int, int, int]:
    """``image`` (``H×W×3`` uint8, pixels contiguous) placed at ``(y, x)`` of a canvas, as the
    kernel takes it."""
    height, width = image.shape[:2]
    return (image.__array_interface__["data"][0], image.strides[0], y, y + height, x, x + width)


def _run_tiles(tiles: list[tuple[int, int, int, int, int, int]], canvas: tuple[int, int],
               matrix: np.ndarray, size: tuple[int, int], border: int) -> np.ndarray:
    """The kernel on a canvas of ``canvas`` ``(height, width)``: ``border`` under ``tiles``."""
    width, height = size
    out = np.empty((height, width, 3), np.uint8)
    m = np.asarray(matrix, np.float64)
    _warp.warp_axis_aligned(tiles, canvas[0], canvas[1], out.ctypes.data, height, width,
                            m[0, 0], m[0, 2], m[1, 1], m[1, 2], border)
    return out


def _unsupported(image: np.ndarray, matrix: np.ndarray, size: tuple[int, int]) -> str | None:
    return _unsupported_image(image) or _unsupported_map(matrix, size)


def _unsupported_image(image: np.ndarray) -> str | None:
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        return f"needs an H×W×3 uint8 image, got {image.dtype} {image.shape}"
    if image.strides[1:] != (3, 1):
        return "needs each row's pixels contiguous"
    return None


def _unsupported_map(matrix: np.ndarray, size: tuple[int, int]) -> str | None:
    m = np.asarray(matrix, np.float64)
    if m.shape not in ((2, 3), (3, 3)) or not np.isfinite(m[:2]).all():
        return f"needs a finite 2×3 or 3×3 matrix, got shape {m.shape}"
    if m[0, 1] != 0 or m[1, 0] != 0 or m[0, 0] == 0 or m[1, 1] == 0:
        return "the matrix rotates, shears or collapses the image"
    width, height = size
    if width <= 0 or height <= 0 or width % _WIDTH_MULTIPLE:
        return f"the output width must be a positive multiple of {_WIDTH_MULTIPLE}, got {width}"
    return None


@functools.cache
def matches_opencv() -> bool:
    """Whether this process's kernel and OpenCV give the same bytes on a probe: zoom in and
    out, sub-pixel offsets, and outputs that run past the image's edges."""
    try:
        import cv2
    except ImportError:
        return False
    if _warp is None or not _warp.available():
        return False
    image = np.random.default_rng(0).integers(0, 256, (157, 211, 3), dtype=np.uint8)
    for scale, dx, dy in ((0.53, -7.31, 3.77), (1.0, 12.5, -0.25), (1.41, -150.6, -60.2),
                          (0.77, 40.13, 33.9)):
        matrix = np.array([[scale, 0, dx], [0, scale * 1.07, dy]], np.float32)
        expected = cv2.warpAffine(image, matrix, dsize=(96, 80),
                                  borderValue=(BORDER,) * 4)
        if not np.array_equal(warp_axis_aligned(image, matrix, (96, 80)), expected):
            return False
    return True


def exact_warp(apply_image: ApplyImage) -> ApplyImage:
    """``RandomPerspective.apply_image``, taking the separable kernel where it gives OpenCV's
    bytes and ``apply_image`` everywhere else; the kernel reads a mosaic canvas left pending by
    :func:`~fastfeed.ultralytics.mosaic.lazy_mosaic` straight from its four images, and
    ``apply_image`` gets it laid out."""

    @functools.wraps(apply_image)
    def warp(self: Any, labels: dict, params: dict) -> dict:
        matrix, size = params["M"], params["size"]
        pending = pending_canvas(labels)
        if pending is not None and any(_unsupported_image(p.image) for p in pending.placements):
            labels["img"], pending = pending.render(), None
        fast = (not self.perspective and matches_opencv()
                and not (_unsupported_map(matrix, size) if pending
                         else _unsupported(labels["img"], matrix, size)))
        if not fast:
            if pending is not None:
                labels["img"] = pending.render()
            return apply_image(self, labels, params)
        if pending is not None:
            tiles = [_tile(p.pixels(), p.y1, p.x1) for p in pending.placements]
            canvas = pending.stand_in.shape[:2]
            labels["img"] = _run_tiles(tiles, canvas, matrix, size, BORDER)
        else:
            labels["img"] = _run(labels["img"], matrix, size, BORDER)
        labels["resized_shape"] = labels["img"].shape[:2]
        return labels

    return warp
