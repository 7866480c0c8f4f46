"""Ultralytics' HSV jitter in one pass, bit-identical to OpenCV's.

``RandomHSV`` converts the image to HSV (``cv2.cvtColor``), maps each channel through a table it
drew (``cv2.LUT``) and converts back: three passes over the image and two temporaries, about a
seventh of a worker's time on the large photos. ``fastfeed._hsv`` does the three steps pixel by
pixel, in place, with OpenCV 5's arithmetic (integer BGR→HSV, float32 HSV→BGR with its fused
multiply-adds, truncated), sixteen pixels at a time with AVX-512, eight with AVX2 (see
``csrc/hsv_jitter.cpp``).

Bit-identity is checked, not assumed: :func:`matches_opencv` runs a probe through both once per
process, and any difference (OpenCV 4 rounds where 5 truncates) leaves every image to OpenCV.
So do images that are not 3-channel ``uint8`` with contiguous pixels, and widths that are not a
multiple of 32: OpenCV computes the last ``width mod 32`` pixels of a row with scalar code that
rounds differently.

In a prepared worker the jitter moves later still (:func:`defer_jitter`): ``RandomHSV`` draws its
table where Ultralytics draws it and leaves the pixels alone; the collate then applies the table
while it gathers the image into the batch's ``C×H×W`` planes (:func:`gather_jittered`), so the
jitter and the layout change are one pass over the pixels instead of two. Only flips, which move
pixels without reading them, may stand between ``RandomHSV`` and ``Format`` for this.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fastfeed.collate import Empty, batch_shape

try:
    from fastfeed import _hsv  # type: ignore[attr-defined]
except ImportError:  # installed without a C++ compiler: every image stays OpenCV's
    _hsv = None

__all__ = ["DeferredJitter", "defer_jitter", "draw_lut", "exact_hsv",
           "gather_jittered", "hsv_jitter", "matches_opencv"]

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


class DeferredJitter:
    """The table ``RandomHSV`` drew for the sample in flight, with the image it is for, held
    until ``Format`` hands that image to the collate (see :func:`defer_jitter`)."""

    def __init__(self) -> None:
        self._image: np.ndarray | None = None
        self._table: np.ndarray | None = None

    def hold(self, image: np.ndarray | None, table: np.ndarray | None) -> None:
        self._image, self._table = image, table

    def take(self, view: np.ndarray) -> np.ndarray | None:
        """The table held for ``view``'s pixels (the image or a mirrored view of it), and
        nothing held after this.

        Raises:
            RuntimeError: a table is held for other pixels: a transform between ``RandomHSV``
                and ``Format`` replaced the image, and its jitter would be lost.
        """
        image, table = self._image, self._table
        self.hold(None, None)
        if table is None:
            return None
        owner = image if image.base is None else image.base  # type: ignore[union-attr]
        if view.shape != image.shape or (view is not image and view.base is not owner):  # type: ignore[union-attr]
            raise RuntimeError("fastfeed: the image reaching Format is not the one RandomHSV "
                               "jittered; patch() defers the jitter only past flips")
        return table


def defer_jitter(transforms: Sequence[Any]) -> DeferredJitter | None:
    """Make the ``RandomHSV`` in ``transforms`` (an Ultralytics pipeline ending in ``Format``, in
    this process) draw its table without applying it, where only flips follow it; the
    :class:`DeferredJitter` that ``Format`` takes the table from, or ``None`` where the jitter
    stays where it is.

    The table is drawn exactly where Ultralytics draws it, so every later random draw is the
    stock one; images the one-pass kernel does not take are jittered on the spot as before.
    """
    from ultralytics.data.augment import RandomFlip, RandomHSV

    found = [i for i, t in enumerate(transforms) if type(t) is RandomHSV]
    if len(found) != 1 or not all(type(t) is RandomFlip for t in transforms[found[0] + 1:-1]):
        return None
    if not matches_opencv() or not hasattr(_hsv, "gather_jittered"):  # an older build
        return None
    transform, deferred = transforms[found[0]], DeferredJitter()
    apply_now = transform.apply_image  # the class's (exact_hsv), bound

    def draw_only(labels: dict, params: dict | None = None) -> dict:
        img = labels["img"]
        deferred.hold(None, None)
        if img.shape[-1] != 3 or not (transform.hgain or transform.sgain or transform.vgain):
            return labels  # RandomHSV leaves these alone and draws nothing
        if _unsupported(img):
            return apply_now(labels, params)
        deferred.hold(img, draw_lut(transform))
        return labels

    transform.apply_image = draw_only
    return deferred


def gather_jittered(images: Sequence[np.ndarray], tables: Sequence[np.ndarray | None],
                    empty: Empty, reverse_channels: Sequence[bool]) -> torch.Tensor:
    """``images`` gathered into one ``N×3×H×W`` uint8 tensor from ``empty``, each mapped
    through its table as :func:`hsv_jitter` maps it (``None``: as it is), channels reversed
    where ``reverse_channels`` says so.

    Raises:
        ValueError: the batch is empty, its images differ in shape, or one is not an
            ``H×W×3`` uint8 view whose pixels lie 3 bytes apart (either way) with contiguous
            channels.
        RuntimeError: fastfeed was installed without its C++ extensions, or a table is given
            on a CPU without AVX2 and FMA.
    """
    height, width = batch_shape(images)[:2]
    for image in images:
        if (image.dtype != np.uint8 or image.shape[2:] != (3,) or abs(image.strides[1]) != 3
                or image.strides[2] != 1):
            raise ValueError(f"gather_jittered: needs H×W×3 uint8 views with pixels 3 bytes "
                             f"apart, got {image.dtype} {image.shape} strides {image.strides}")
    if _hsv is None or (any(t is not None for t in tables) and not _hsv.available()):
        raise RuntimeError("fastfeed._hsv was not built, or this CPU lacks AVX2 and FMA")
    out = empty((len(images), 3, height, width), torch.uint8)
    tables = [None if t is None else np.ascontiguousarray(t, np.uint8) for t in tables]
    _hsv.gather_jittered(out.data_ptr(), [
        (image.__array_interface__["data"][0], image.strides[0], image.strides[1] < 0, reverse,
         0 if table is None else table.ctypes.data)
        for image, table, reverse in zip(images, tables, reverse_channels, strict=True)],
        height, width)
    return out
