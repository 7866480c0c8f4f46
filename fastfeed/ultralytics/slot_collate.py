"""Ultralytics' ``collate_fn`` with ``batch["img"]`` gathered straight into the pool slot.

Stock, each worker's ``Format`` copies every image to a contiguous ``C×H×W`` tensor (reversing
BGR to RGB), ``YOLODataset.collate_fn`` stacks those into a batch, and a loader then copies the
batch into shared memory: three passes over the pixels. Here, inside each worker, ``Format``
hands over the ``H×W×C`` view it was given (mirrored by the flips or not) and the channel order
it drew, and the collate gathers every image transposed, in its channel order, into the slot:
one pass, which also applies ``RandomHSV``'s jitter where that transform only drew its table
(:func:`fastfeed.ultralytics.hsv.defer_jitter`). Ultralytics' own code draws every random
number and builds every other key; the batch is the stock one, byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from fastfeed.collate import Empty, gather_images, torch_empty
from fastfeed.ultralytics.format import draws_reverse, lean_format
from fastfeed.ultralytics.hsv import defer_jitter, gather_jittered

__all__ = ["FormattedImage", "InWorkers", "SlotCollate", "flatten",
           "format_into_slot", "gathers_images"]

class FormattedImage(NamedTuple):
    """An image ``Format`` left for the collate: its ``H×W×C`` view, channel order, and the HSV
    table still to apply to it (see :func:`fastfeed.ultralytics.hsv.defer_jitter`)."""

    hwc: np.ndarray
    reverse: bool
    hsv_table: np.ndarray | None = None


def flatten(transform: Any) -> Iterator[Any]:
    """The transforms of an Ultralytics ``Compose``, nested ones in order."""
    from ultralytics.data.augment import Compose

    if isinstance(transform, Compose):
        for inner in transform.transforms:
            yield from flatten(inner)
    else:
        yield transform


def gathers_images(dataset: Any, collate_fn: Any) -> bool:
    """Whether ``dataset``'s batches can have their images gathered by :class:`SlotCollate`:
    Ultralytics' ``YOLODataset.collate_fn`` over transforms that end with its ``Format``."""
    try:
        from ultralytics.data.augment import Format
        from ultralytics.data.dataset import YOLODataset
    except ImportError:
        return False
    transforms = list(flatten(getattr(dataset, "transforms", None)))
    return (collate_fn is YOLODataset.collate_fn and bool(transforms)
            and type(transforms[-1]) is Format)


def format_into_slot(dataset: Any) -> None:
    """Make ``dataset``'s ``Format`` (in this process) hand its images to :class:`SlotCollate`,
    with ``RandomHSV``'s jitter left to the gather where it can be."""
    transforms = list(flatten(dataset.transforms))
    transform = transforms[-1]
    format_img = transform._format_img
    draw = lean_format(transform) or (lambda channels: draws_reverse(format_img, channels))
    deferred = defer_jitter(transforms)

    def formatted(img: np.ndarray) -> FormattedImage:
        hwc = img if img.ndim == 3 else img[..., None]
        table = None if deferred is None else deferred.take(hwc)
        return FormattedImage(hwc, draw(hwc.shape[2]), table)

    transform._format_img = formatted


class InWorkers:
    """A ``worker_init_fn`` that applies ``prepare`` to the worker's dataset, then ``init``.

    Workers restart after Ultralytics rebuilds the transforms (``close_mosaic``), so every
    worker prepares the transforms it was given; the main process's dataset stays stock.
    """

    def __init__(self, prepare: Callable[[Any], None], init: Callable[[int], None] | None
                 ) -> None:
        self.prepare = prepare
        self.init = init

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        if info is not None:
            self.prepare(info.dataset)
        if self.init is not None:
            self.init(worker_id)


class SlotCollate:
    """Ultralytics' ``collate_fn``, with ``batch["img"]`` written straight into the pool slot.

    A sample's ``img`` is a :class:`FormattedImage` (gathered as ``C×H×W``), or a tensor
    (stacked as it is: ``Format``'s own output where the workers were not prepared, or a canvas
    for the device). Every other key is Ultralytics' collate.
    """

    def __init__(self, collate_fn: Callable[[list], dict]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: list[dict]) -> dict:
        return self.collate_into(samples, torch_empty)

    def collate_into(self, samples: list[dict], empty: Empty) -> dict:
        """Collate ``samples``, taking ``batch["img"]`` from ``empty(shape, dtype)``."""
        images = [sample["img"] for sample in samples]
        batch = self.collate_fn([{k: v for k, v in s.items() if k != "img"} for s in samples])
        return dict(sorted({**batch, "img": self.gather(images, empty)}.items()))  # as Ultralytics

    def gather(self, images: list, empty: Empty) -> torch.Tensor:
        """The batch's images as one tensor from ``empty``."""
        if images and isinstance(images[0], FormattedImage):
            views, reverse = [i.hwc for i in images], [i.reverse for i in images]
            if any(i.hsv_table is not None for i in images):
                return gather_jittered(views, [i.hsv_table for i in images], empty, reverse)
            return gather_images(views, empty, reverse)
        return gather_images(images, empty)
