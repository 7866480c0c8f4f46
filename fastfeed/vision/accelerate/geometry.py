"""The prefix's geometry folded into one window of the source image, drawn with the
transforms' own random draws in their own order."""

from __future__ import annotations

import random
from typing import Any

import torch

from fastfeed.vision.accelerate.recognise import CROPS, TIMM_RRC, interpolation_mode
from fastfeed.vision.accelerate.torch_draws import (
    Draws,
    Undecided,
    draw_session,
    draws_like_torchvision,
)
from fastfeed.vision.window_decode import Box

__all__ = ["SourceWindow", "draw_window", "needs_padding"]


def _resized_size(size: Any, max_size: int | None, width: int, height: int) -> tuple[int, int]:
    """``Resize``'s output (width, height), as torchvision computes it."""
    if isinstance(size, int) or len(size) == 1:
        requested = size if isinstance(size, int) else size[0]
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = requested, int(requested * long / short)
        if max_size is not None and new_long > max_size:
            new_short, new_long = int(max_size * new_short / new_long), max_size
        return (new_short, new_long) if width <= height else (new_long, new_short)
    return size[1], size[0]


def _center_crop_offsets(width: int, height: int, crop_w: int, crop_h: int) -> tuple[int, int]:
    return round((width - crop_w) / 2.0), round((height - crop_h) / 2.0)


def _pair(size: Any) -> tuple[int, int]:
    """(width, height) from torchvision's ``size`` (an int or ``[h, w]``)."""
    if isinstance(size, int):
        return size, size
    return (size[0], size[0]) if len(size) == 1 else (size[1], size[0])


class SourceWindow:
    """The current image as a rectangle of the source (float pixels), its size, whether it is
    mirrored, the interpolation of the last resize, and the region of the source that resize
    read (``bounds``: left, top, right, bottom; a crop after it narrows the window, not the
    region its filter taps)."""

    def __init__(self, width: int, height: int) -> None:
        self.x, self.y, self.w, self.h = 0.0, 0.0, float(width), float(height)
        self.width, self.height = width, height
        self.flipped = False
        self.mode = "bilinear"
        self.bounds = (0.0, 0.0, float(width), float(height))

    def crop(self, left: int, top: int, width: int, height: int) -> None:
        scale_x, scale_y = self.w / self.width, self.h / self.height
        if self.flipped:  # the current image's left is the source window's right
            left = self.width - left - width
        self.x += left * scale_x
        self.y += top * scale_y
        self.w, self.h = width * scale_x, height * scale_y
        self.width, self.height = width, height

    def resize(self, size: tuple[int, int], interpolation: Any) -> None:
        mode = interpolation_mode(interpolation)
        assert mode is not None, "the plan lets only bilinear and bicubic resizes through"
        self.width, self.height = size
        self.mode = mode
        self.bounds = (self.x, self.y, self.x + self.w, self.y + self.h)

    def source_box(self, image_width: int, image_height: int) -> Box:
        left, top = round(self.x), round(self.y)
        right = min(image_width, max(left + 1, round(self.x + self.w)))
        bottom = min(image_height, max(top + 1, round(self.y + self.h)))
        return left, top, right - left, bottom - top


def _size_stub(width: int, height: int) -> torch.Tensor:
    """A 3×H×W tensor without memory: what ``get_params`` reads sizes from."""
    return torch.empty((), dtype=torch.uint8).expand(3, height, width)


def _random_resized_crop(name: str, transform: Any, width: int, height: int,
                         draws: Draws | None) -> tuple[Box, Any]:
    """((left, top, width, height), interpolation) drawn by the transform's own code: torch's
    generator for torchvision's, Python's ``random`` for timm's (the window, then the
    interpolation when it is ``"random"``), in that library's order; or, given ``draws``, the
    numbers torchvision's own code would draw (:mod:`~.torch_draws`)."""
    if draws is not None:
        top, left, h, w = draws.resized_crop(width, height, transform.scale, transform.ratio)
        return (left, top, w, h), transform.interpolation
    stub = _size_stub(width, height)
    if name == TIMM_RRC:
        top, left, h, w = transform.get_params(stub, transform.scale, transform.ratio)
        modes = transform.interpolation
        return (left, top, w, h), (random.choice(modes) if isinstance(modes, (tuple, list))
                                   else modes)
    if hasattr(transform, "make_params"):  # v2
        params = transform.make_params([stub])
        return ((params["left"], params["top"], params["width"], params["height"]),
                transform.interpolation)
    top, left, h, w = transform.get_params(stub, transform.scale, transform.ratio)
    return (left, top, w, h), transform.interpolation


def draw_window(geometry: list[tuple[str, Any]], width: int, height: int) -> SourceWindow:
    """Fold the prefix's geometry into one window of a ``width``×``height`` source, with the
    transforms' own draws: where every crop is torchvision's own ``RandomResizedCrop``, the
    numbers its ops would draw, made without them where this thread may
    (:func:`~.torch_draws.draw_session`)."""
    draws = None
    if all(name not in CROPS or draws_like_torchvision(t) for name, t in geometry):
        draws = draw_session()
    if draws is not None:
        try:
            window = _fold(geometry, width, height, draws)
        except Undecided:
            pass  # nothing committed: torch's ops draw this image
        else:
            draws.commit()
            return window
    return _fold(geometry, width, height, None)


def _fold(geometry: list[tuple[str, Any]], width: int, height: int,
          draws: Draws | None) -> SourceWindow:
    window = SourceWindow(width, height)
    for name, transform in geometry:
        if name in CROPS:
            box, interpolation = _random_resized_crop(name, transform, window.width,
                                                      window.height, draws)
            window.crop(*box)
            window.resize(_pair(transform.size), interpolation)
        elif name == "Resize":
            window.resize(_resized_size(transform.size, transform.max_size, window.width,
                                        window.height), transform.interpolation)
        elif name == "CenterCrop":
            crop_w, crop_h = _pair(transform.size)
            window.crop(*_center_crop_offsets(window.width, window.height, crop_w, crop_h),
                        crop_w, crop_h)
        else:  # RandomHorizontalFlip: torchvision's draw
            chance = draws.rand() if draws is not None else float(torch.rand(1))
            if chance < transform.p:
                window.flipped = not window.flipped
    return window


def needs_padding(geometry: list[tuple[str, Any]], width: int, height: int) -> bool:
    """Whether a ``CenterCrop`` would pad. Sizes do not depend on the random draws, so this
    is known before any is made."""
    for name, transform in geometry:
        if name in CROPS:
            width, height = _pair(transform.size)
        elif name == "Resize":
            width, height = _resized_size(transform.size, transform.max_size, width, height)
        elif name == "CenterCrop":
            crop_w, crop_h = _pair(transform.size)
            if crop_w > width or crop_h > height:
                return True
            width, height = crop_w, crop_h
    return False
