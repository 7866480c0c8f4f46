"""Ultralytics' 2×2 mosaic, never laid out where the random perspective warp reads it.

``Mosaic.apply_image`` fills a ``2·imgsz`` square canvas with grey (4.9 MB at imgsz 640) and
copies four images into it; ``RandomPerspective`` then warps it to ``imgsz``, and with
Ultralytics' default scale jitter the warp reads about 40 % of the canvas. Here, in the loader's
workers, the mosaic records its four placements and leaves a grey stand-in of the canvas's
shape (a zero-stride view: nothing allocated); the separable warp
(:mod:`fastfeed.ultralytics.warp`) then reads the rows it needs straight from the four images,
grey between them, and only OpenCV's warp gets the canvas laid out (:meth:`PendingCanvas.render`).
The pixels the warp reads are the stock canvas's, so its output is the stock one byte for byte;
every random number is drawn by Ultralytics' own code.

Only pipelines in which nothing reads the canvas between the mosaic and the warp qualify
(Ultralytics' defaults: ``copy_paste=0``); :func:`defer_canvases` marks their mosaics.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from fastfeed.ultralytics.slot_collate import flatten

__all__ = ["PendingCanvas", "defer_canvases", "lazy_mosaic", "pending_canvas"]

BORDER = 114  # Ultralytics' fill value for mosaic canvases
_KEY = "fastfeed_pending_canvas"
_DEFERS = "_fastfeed_defers_canvas"  # set on the Mosaic instances of a qualifying pipeline

ApplyImage = Callable[..., dict]


class Placement(NamedTuple):
    """One image's part of the canvas: ``image[top:, left:]`` goes to ``[y1:y2, x1:x2]``."""

    image: np.ndarray
    y1: int
    y2: int
    x1: int
    x2: int
    top: int
    left: int

    def pixels(self) -> np.ndarray:
        """The part of ``image`` that the canvas shows."""
        return self.image[self.top:self.top + self.y2 - self.y1,
                          self.left:self.left + self.x2 - self.x1]


class PendingCanvas(NamedTuple):
    """A mosaic canvas not laid out yet: its stand-in and its placements."""

    stand_in: np.ndarray
    placements: tuple[Placement, ...]

    def render(self) -> np.ndarray:
        """The canvas, laid out."""
        canvas = np.full(self.stand_in.shape, BORDER, np.uint8)
        for p in self.placements:
            canvas[p.y1:p.y2, p.x1:p.x2] = p.pixels()
        return canvas


@functools.cache
def _stand_in(shape: tuple[int, int, int]) -> np.ndarray:
    return np.broadcast_to(np.uint8(BORDER), shape)  # read-only, no memory


def pending_canvas(labels: dict) -> PendingCanvas | None:
    """The pending canvas that ``labels["img"]`` stands in for, taken out of ``labels``, or
    ``None`` if the image is a real one."""
    pending = labels.pop(_KEY, None)
    return pending if pending is not None and labels["img"] is pending.stand_in else None


def lazy_mosaic(apply_image: ApplyImage) -> ApplyImage:
    """``Mosaic.apply_image``, recording the 2×2 layout instead of filling the canvas on the
    mosaics :func:`defer_canvases` marked, and ``apply_image`` everywhere else."""

    @functools.wraps(apply_image)
    def mosaic(self: Any, labels: dict, params: dict | None = None) -> dict:
        img = labels["img"]
        if not getattr(self, _DEFERS, False) or self.n != 4 or img.ndim != 3 or img.shape[2] != 3:
            return apply_image(self, labels, params)
        placements = tuple(
            Placement(item["labels_patch"]["img"], item["y1a"], item["y2a"], item["x1a"],
                      item["x2a"], item["y1b"], item["x1b"])
            for item in params["layout"])  # type: ignore[index]
        if any(p.image.dtype != np.uint8 or p.image.ndim != 3 for p in placements):
            return apply_image(self, labels, params)
        stand_in = _stand_in((2 * self.imgsz, 2 * self.imgsz, 3))
        labels["img"] = stand_in
        labels[_KEY] = PendingCanvas(stand_in, placements)
        return labels

    return mosaic


def defer_canvases(dataset: Any) -> None:
    """Mark the mosaics of ``dataset`` (in this process) whose canvas goes straight to
    ``RandomPerspective``, with nothing between them that reads pixels."""
    from ultralytics.data import augment as A

    transforms = list(flatten(getattr(dataset, "transforms", None)))
    for i, t in enumerate(transforms):
        if type(t) is not A.Mosaic:
            continue
        rest = transforms[i + 1:]
        warp = next((j for j, u in enumerate(rest) if isinstance(u, A.RandomPerspective)), None)
        between = rest[:warp] if warp is not None else [None]
        if all(isinstance(u, A.CopyPaste) and u.p == 0 for u in between):
            setattr(t, _DEFERS, True)
