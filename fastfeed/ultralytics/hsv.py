"""Ultralytics' HSV jitter in one pass, bit-identical to OpenCV's.

``RandomHSV`` converts the image to HSV (``cv2.cvtColor``), maps each channel through a table it
drew (``cv2.LUT``) and converts back: three passes over the image and two temporaries, about a
seventh of a worker's time on the large photos. ``fastfeed._hsv`` does the three steps pixel by
pixel, in place, with OpenCV 5's arithmetic (integer BGR→HSV, float32 HSV→BGR with its fused
multiply-adds, truncated), eight pixels at a time (see ``csrc/hsv_jitter.cpp``).

Bit-identity is checked, not assumed: :func:`matches_opencv` runs a probe through both once per
process, and any difference (OpenCV 4 rounds where 5 truncates) leaves every image to OpenCV.
So do images that are not 3-channel ``uint8`` with contiguous pixels, and widths that are not a
multiple of 32: OpenCV computes the last ``width mod 32`` pixels of a row with scalar code that
rounds differently.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

try:
    from fastfeed import _hsv  # type: ignore[attr-defined]
except ImportError:  # installed without a C++ compiler: every image stays OpenCV's
    _hsv = None

__all__ = ["draw_lut", "exact_hsv", "hsv_jitter", "matches_opencv"]

_WIDTH_MULTIPLE = 32

ApplyImage = Callable[..., dict]


def draw_lut(hsv: Any) -> np.ndarray:
    """The ``3×256`` table ``RandomHSV.apply_image`` builds, from the same draw of the global
    numpy RNG (hue, saturation, value rows)."""
    r = np.random.uniform(-1, 1, 3) * [hsv.hgain, hsv.sgain, hsv.vgain]
    x = np.arange(0, 256, dtype=r.dtype)
    lut_hue = ((x + r[0] * 180) % 180).astype(np.uint8)
    lut_sat = np.clip(x * (r[1] + 1), 0, 255).astype(np.uint8)
    lut_val = np.clip(x * (r[2] + 1), 0, 255).astype(np.uint8)
    lut_sat[0] = 0
    return np.stack((lut_hue, lut_sat, lut_val))


def hsv_jitter(image: np.ndarray, lut: np.ndarray) -> None:
    """Map ``image`` (``H×W×3`` uint8 BGR) through HSV and ``lut`` in place, as
    ``cv2.cvtColor(cv2.LUT(cv2.cvtColor(image, BGR2HSV), lut), HSV2BGR, dst=image)``.

    Raises:
        ValueError: the image or table is not one this kernel takes.
        RuntimeError: fastfeed was installed without its C++ extensions.
    """
    if _hsv is None:
        raise RuntimeError("fastfeed._hsv was not built (no C++ compiler at install time)")
    reason = _unsupported(image)
    if reason:
        raise ValueError(f"hsv_jitter: {reason}")
    _run(image, np.ascontiguousarray(lut, np.uint8).reshape(3, 256))


def _run(image: np.ndarray, lut: np.ndarray) -> None:
    _hsv.hsv_jitter(image.ctypes.data, image.shape[0], image.shape[1], image.strides[0],
                    lut.ctypes.data)


def _unsupported(image: np.ndarray) -> str | None:
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        return f"needs an H×W×3 uint8 image, got {image.dtype} {image.shape}"
    if image.strides[1:] != (3, 1) or not image.flags.writeable:
        return "needs a writeable image with each row's pixels contiguous"
    if image.shape[1] % _WIDTH_MULTIPLE:
        return f"the width must be a multiple of {_WIDTH_MULTIPLE}, got {image.shape[1]}"
    return None


def _opencv_jitter(image: np.ndarray, lut: np.ndarray) -> np.ndarray:
    import cv2  # Ultralytics' dependency, imported only where it is used

    out = image.copy()
    hsv = cv2.cvtColor(out, cv2.COLOR_BGR2HSV)
    cv2.cvtColor(cv2.LUT(hsv, lut.T.reshape(1, 256, 3).copy()), cv2.COLOR_HSV2BGR, dst=out)
    return out


@functools.cache
def matches_opencv() -> bool:
    """Whether this process's kernel and OpenCV give the same bytes on a probe: noise, and
    greys (hue undefined), under a table that moves all three channels."""
    try:
        import cv2  # noqa: F401
    except ImportError:
        return False
    if _hsv is None or not _hsv.available():
        return False
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (48, 640, 3), dtype=np.uint8)
    image[:8] = image[:8, :, :1]  # greys
    x = np.arange(256)
    lut = np.stack([(x + 40) % 180, np.clip(x * 1.4, 0, 255), np.clip(x * 0.7, 0, 255)])
    lut = lut.astype(np.uint8)
    expected = _opencv_jitter(image, lut)
    got = image.copy()
    _run(got, lut)
    return bool(np.array_equal(got, expected))


def exact_hsv(apply_image: ApplyImage) -> ApplyImage:
    """``RandomHSV.apply_image``, taking the one-pass kernel where it gives OpenCV's bytes and
    ``apply_image`` everywhere else. The table is drawn exactly as Ultralytics draws it."""

    @functools.wraps(apply_image)
    def jitter(self: Any, labels: dict, params: dict | None = None) -> dict:
        img = labels["img"]
        if (not (self.hgain or self.sgain or self.vgain) or _unsupported(img)
                or not matches_opencv()):
            return apply_image(self, labels, params)
        _run(img, draw_lut(self))
        return labels

    return jitter
