"""The accelerated dataset's pieces: its loader (which reads bytes) and its transform (which
runs the prefix by window decode and the tail by the user's objects)."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from fastfeed.tail_split import BatchTailSplit
from fastfeed.vision.accelerate.geometry import draw_window, needs_padding
from fastfeed.vision.accelerate.plan import Plan
from fastfeed.vision.accelerate.tail_ops import BatchTail, TailCollate, convert, run, tail_ops
from fastfeed.vision.window_decode import decode_resized_crop, image_size

__all__ = ["EncodedImage", "FusedTransform", "deferred_for_device", "read_encoded",
           "with_transform"]

# The reduced DCT scale keeps the decoded window at twice the output size, not once: at once,
# sharp photos lose detail that Pillow's full decode keeps (RESULTS.md, "accelerate's pixels
# on real photos"), and the larger window costs no measured speed.
_DCT_MARGIN = 2


@dataclass
class EncodedImage:
    """A file's bytes, read by the accelerated dataset's loader; decoded by the transform."""

    path: str
    data: bytes

    def to_pil(self) -> Image.Image:
        """What torchvision's ``pil_loader`` returns for this file."""
        with Image.open(io.BytesIO(self.data)) as image:
            return image.convert("RGB")


def read_encoded(path: str) -> EncodedImage:
    """The accelerated dataset's ``loader``: read the file, decode nothing yet."""
    with open(path, "rb") as f:
        return EncodedImage(path, f.read())


class FusedTransform:
    """The user's transform, run from encoded bytes: the prefix by window decode, the tail by
    the user's objects; the same random draws in the same order.

    Args:
        original: the user's transform (kept for repr and for samples that must take the
            stock path: a ``CenterCrop`` that pads).
        plan: what :func:`accelerate` compiled from it.
        defer_tail: stop at uint8 CHW (in H×W×C memory, as the resize wrote it);
            :class:`BatchTail` finishes each batch on the device
            (only for a tail of elementwise tensor ops).
    """

    def __init__(self, original: Any, plan: Plan, defer_tail: bool = False) -> None:
        self.original = original
        self.plan = plan
        self.defer_tail = defer_tail
        self.tail = tail_ops(plan.tail)

    def __repr__(self) -> str:
        inner = repr(self.original).replace("\n", "\n    ")
        return f"FusedTransform(\n    {inner}\n)"

    def split_batch_tail(self, dataset: Dataset) -> BatchTailSplit | None:
        """The :mod:`fastfeed.tail_split` hook: ``dataset`` (whose transform this is) with items
        stopped at uint8, and the tail that finishes its batches (see
        :func:`deferred_for_device`)."""
        deferred = deferred_for_device(dataset)
        if deferred is None:
            return None
        dataset, tail = deferred
        return BatchTailSplit(dataset, tail, TailCollate(tail), tail.finish_into)

    def __call__(self, encoded: EncodedImage) -> Any:
        if not isinstance(encoded, EncodedImage):
            raise TypeError("FusedTransform takes what fastfeed's read_encoded returns, got "
                            f"{type(encoded).__name__}: keep the dataset's loader")
        width, height = image_size(encoded.data, encoded.path)
        if needs_padding(self.plan.geometry, width, height):
            if self.defer_tail:  # the stock geometry (its draws, its padding), as uint8 CHW
                image = run([t for _, t in self.plan.geometry], encoded.to_pil())
                return torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()
            return self.original(encoded.to_pil())
        window = draw_window(self.plan.geometry, width, height)
        box = window.source_box(width, height)
        # A deferred image is gathered (TailCollate) or stacked (stack_into) from H×W×C
        # memory as cheaply as from C×H×W, so it is left as the resize wrote it.
        image = decode_resized_crop(encoded.data, lambda _w, _h: box,
                                    (window.width, window.height), encoded.path,
                                    mode=window.mode, dct_margin=_DCT_MARGIN,
                                    channels_last=self.defer_tail)
        if window.flipped:
            image = image.flip(-1)
        if self.defer_tail:
            return image
        return run(self.tail, convert(image, self.plan.conversion))


def with_transform(dataset: Dataset, transform: Callable[[EncodedImage], Any]) -> Dataset:
    """A shallow copy of ``dataset`` that reads bytes and runs ``transform``."""
    fast = copy.copy(dataset)
    fast.loader = read_encoded  # type: ignore[attr-defined]
    fast.transform = transform  # type: ignore[attr-defined]
    return fast


def deferred_for_device(dataset: Dataset) -> tuple[Dataset, BatchTail] | None:
    """What a loader with a ``device`` ships instead of an accelerated dataset's float items.

    When ``dataset`` comes from :func:`accelerate` (without ``defer_tail``) and its tail can run
    on whole batches, returns the same dataset with items stopped at uint8 and the
    :class:`BatchTail` that finishes each batch on the device, with values identical to the
    per-sample items'; else ``None`` (ship the items as they are).
    """
    transform = getattr(dataset, "transform", None)
    if (not isinstance(transform, FusedTransform) or transform.defer_tail
            or transform.plan.per_sample_piece() is not None):
        return None
    deferred = FusedTransform(transform.original, transform.plan, defer_tail=True)
    return with_transform(dataset, deferred), BatchTail(transform.plan)
