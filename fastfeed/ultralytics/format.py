"""Ultralytics' ``Format`` for detection, with numpy where it runs torch ops on a few numbers.

Per sample, ``Format.apply_instances`` wraps the labels in tensors and normalises the boxes with
two advanced-index divisions in place on a tensor, and ``Format._format_img`` draws the channel
order, which :func:`draws_reverse` reads back through a tensor. Each of these torch calls moves
a handful of numbers, but in a worker whose caches the pixel work has just swept they cost
about 3 % of a sample's CPU time together (py-spy, large photos, ``fast_decode``). In a prepared
worker, :func:`lean_format` has the detection ``Format`` do the same with numpy on the arrays
and one ``torch.from_numpy`` per key, and draw the channel order with the same
``random.uniform`` call.

Equality is checked, not assumed: a probe runs the stock methods and the lean ones on the same
labels and random states once per ``Format`` instance, and any difference (another Ultralytics
version's ``Format``) leaves that instance stock. Masks, keypoints and oriented boxes always
stay stock.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["draws_reverse", "lean_format"]

DrawReverse = Callable[[int], bool]


def draws_reverse(format_img: Callable[[np.ndarray], torch.Tensor], channels: int) -> bool:
    """Whether Ultralytics' ``Format._format_img`` reverses the channels this time: the stock
    call on a 1×1 marker makes the same random draw (for any channel count) and shows its
    decision."""
    marker = np.arange(channels, dtype=np.uint8).reshape(1, 1, -1)
    first = int(format_img(marker)[0, 0, 0])
    return channels > 1 and first == channels - 1


def lean_format(transform: Any) -> DrawReverse | None:
    """Give ``transform`` (an Ultralytics ``Format``, in this process) the lean
    ``apply_instances`` where a probe shows it gives the stock tensors, and return the lean
    channel-order draw (``channels -> reverse?``) where a probe shows it draws as
    ``_format_img`` does; ``None``: keep reading the draw through ``_format_img``."""
    from ultralytics.data.augment import Format

    if type(transform) is not Format or transform.return_mask or transform.return_keypoint \
            or transform.return_obb:
        return None
    lean = _LeanInstances(transform)
    if _same_tensors(transform, lean):
        transform.apply_instances = lean
    return _draw_reverse(transform) if _draws_alike(transform) else None


class _LeanInstances:
    """``Format.apply_instances`` for boxes and classes only, with numpy ops."""

    def __init__(self, transform: Any) -> None:
        self.normalize = transform.normalize
        self.batch_idx = transform.batch_idx
        self.stock = transform.apply_instances

    def __call__(self, labels: dict, params: dict) -> dict:
        cls, instances = params.get("cls", np.array([])), params.get("instances")
        if instances is None:  # stock refuses it, and says why
            return self.stock(labels, params)
        h, w, nl = params.get("h", 0), params.get("w", 0), params.get("nl", 0)
        labels["cls"] = torch.from_numpy(cls) if nl else torch.zeros(nl, 1)
        if nl:
            bboxes = instances.bboxes  # Format's tensor shares this memory, divisions included
            if self.normalize:
                bboxes[:, [0, 2]] /= w
                bboxes[:, [1, 3]] /= h
            labels["bboxes"] = torch.from_numpy(bboxes)
        else:
            labels["bboxes"] = torch.zeros((nl, 4))
        if self.batch_idx:
            labels["batch_idx"] = torch.zeros(nl)
        return labels


def _draw_reverse(transform: Any) -> DrawReverse:
    bgr = transform.bgr

    def reverse(channels: int) -> bool:
        return random.uniform(0, 1) > bgr and channels == 3  # _format_img's draw, in its order

    return reverse


def _probe_labels(rng: np.random.Generator, boxes: int) -> tuple[dict, dict]:
    """Two copies of a labels dict as ``Format`` receives it: ``boxes`` boxes, pixel xywh."""
    from ultralytics.utils.instance import Instances

    xywh = np.abs(rng.normal(50, 30, (boxes, 4))).astype(np.float32) + 1
    cls = rng.integers(0, 8, (boxes, 1)).astype(np.float32)
    image = np.zeros((96, 160, 3), np.uint8)
    return tuple(  # type: ignore[return-value]
        {"img": image, "cls": cls.copy(),
         "instances": Instances(xywh.copy(), bbox_format="xywh", normalized=False)}
        for _ in range(2))


def _same_tensors(transform: Any, lean: _LeanInstances) -> bool:
    """Whether ``lean`` gives the tensors of ``transform.apply_instances`` on probe labels."""
    rng = np.random.default_rng(0)
    for boxes in (0, 1, 5):
        stock_labels, lean_labels = _probe_labels(rng, boxes)
        params = transform.get_params(stock_labels)
        expected = transform.apply_instances(stock_labels, params)
        got = lean(lean_labels, transform.get_params(lean_labels))
        if expected.keys() != got.keys():
            return False
        for key, value in expected.items():
            if isinstance(value, torch.Tensor) and not (
                    isinstance(got[key], torch.Tensor) and value.dtype == got[key].dtype
                    and value.shape == got[key].shape and torch.equal(value, got[key])):
                return False
    return True


def _draws_alike(transform: Any) -> bool:
    """Whether :func:`_draw_reverse` decides as ``transform._format_img`` does and leaves the
    random stream where it does, for grey and colour images."""
    lean = _draw_reverse(transform)
    state = random.getstate()
    try:
        for seed in range(16):
            for channels in (1, 3):
                random.seed(seed)
                stock = draws_reverse(transform._format_img, channels), random.random()
                random.seed(seed)
                if (lean(channels), random.random()) != stock:
                    return False
    finally:
        random.setstate(state)
    return True
