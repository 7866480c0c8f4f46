"""``YoloDataset``: ``images/`` plus ``labels/*.txt`` (``cls cx cy w h``, normalised)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from fastfeed.skip import SKIP
from fastfeed.vision.augment import letterbox_geometry, random_flip
from fastfeed.vision.folder import IMG_EXTENSIONS, _check_on_error
from fastfeed.vision.window_decode import DecodeError, decode_resized_crop, image_size

__all__ = ["YoloDataset", "letterbox_boxes", "parse_labels"]

PAD_VALUE = 114  # Ultralytics' letterbox grey


def parse_labels(path: str | Path) -> np.ndarray:
    """Rows ``cls cx cy w h`` of a YOLO label file as an (n, 5) float32 array.

    A missing file means no objects (as in Ultralytics). A malformed row raises
    ``ValueError`` naming the file and line.
    """
    if not os.path.exists(path):
        return np.zeros((0, 5), dtype=np.float32)
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                continue
            try:
                values = [float(v) for v in fields]
            except ValueError:
                raise ValueError(f"{path}:{number}: not a number in {line.strip()!r}") from None
            if len(values) != 5:
                raise ValueError(f"{path}:{number}: expected 5 values 'cls cx cy w h', got "
                                 f"{len(values)} (segment labels are not supported)")
            rows.append(values)
    return np.asarray(rows, dtype=np.float32).reshape(-1, 5)


def letterbox_boxes(boxes: np.ndarray, width: int, height: int, size: int) -> np.ndarray:
    """Map normalised ``cx cy w h`` boxes of a ``width × height`` image into its letterbox."""
    _, new_w, new_h, left, top = letterbox_geometry(width, height, size)
    out = boxes.astype(np.float32, copy=True)
    out[:, 0] = (boxes[:, 0] * new_w + left) / size
    out[:, 1] = (boxes[:, 1] * new_h + top) / size
    out[:, 2] = boxes[:, 2] * new_w / size
    out[:, 3] = boxes[:, 3] * new_h / size
    return out


class YoloDataset(Dataset):
    """A YOLO-format detection set: ``root/images/*`` with ``root/labels/<stem>.txt``.

    Each item is a dict: ``img`` (uint8 ``3 × imgsz × imgsz``, letterboxed with grey 114),
    ``cls`` (n, 1) and ``bboxes`` (n, 4) normalised ``cx cy w h`` in the letterboxed image,
    ``im_file`` and ``ori_shape`` (h, w). With ``train``, images and boxes flip left-right
    with probability ``flip_p``. Collate with :class:`YoloCollate` for Ultralytics' batch.

    Args:
        root: folder holding ``images/`` and ``labels/``.
        imgsz: letterbox side in pixels.
        train: random flips.
        flip_p: flip probability.
        on_error: ``"raise"`` or ``"skip"`` for images that cannot be decoded.
    """

    def __init__(self, root: str | Path, imgsz: int = 640, train: bool = True,
                 flip_p: float = 0.5, on_error: str = "raise") -> None:
        self.root = str(root)
        images = os.path.join(self.root, "images")
        if not os.path.isdir(images):
            raise FileNotFoundError(f"YoloDataset: {images} is not a directory")
        self.imgsz, self.train, self.flip_p = imgsz, train, flip_p
        self.on_error = _check_on_error(on_error)
        self.im_files = sorted(
            os.path.join(folder, file)
            for folder, _, files in os.walk(images) for file in files
            if file.lower().endswith(IMG_EXTENSIONS))
        if not self.im_files:
            raise FileNotFoundError(f"YoloDataset: no images under {images}")
        self.label_files = [self._label_path(p) for p in self.im_files]

    def _label_path(self, image_path: str) -> str:
        relative = os.path.relpath(image_path, os.path.join(self.root, "images"))
        return os.path.join(self.root, "labels", os.path.splitext(relative)[0] + ".txt")

    def __len__(self) -> int:
        return len(self.im_files)

    def __getitem__(self, index: int) -> Any:
        path = self.im_files[index]
        labels = parse_labels(self.label_files[index])
        size = self.imgsz
        try:
            with open(path, "rb") as f:
                data = f.read()
            width, height = image_size(data, path)
            _, new_w, new_h, left, top = letterbox_geometry(width, height, size)
            # The whole image, decoded at the coarsest DCT scale that still covers the letterbox.
            resized = decode_resized_crop(data, lambda w, h: (0, 0, w, h), (new_w, new_h), path)
        except DecodeError:
            if self.on_error == "skip":
                return SKIP
            raise
        image = torch.full((3, size, size), PAD_VALUE, dtype=torch.uint8)
        image[:, top:top + new_h, left:left + new_w] = resized
        boxes = letterbox_boxes(labels[:, 1:], width, height, size)
        if self.train and random_flip(self.flip_p):
            image = image.flip(-1)
            boxes[:, 0] = 1.0 - boxes[:, 0]
        return {"img": image, "cls": labels[:, :1].copy(), "bboxes": boxes, "im_file": path,
                "ori_shape": (height, width)}
