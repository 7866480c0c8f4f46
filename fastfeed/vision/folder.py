"""``ImageFolder``: torchvision's class-per-folder layout, decoded the fast way."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from fastfeed.skip import SKIP
from fastfeed.vision.augment import center_crop_box, random_flip, random_resized_crop_box
from fastfeed.vision.window_decode import DecodeError, decode_resized_crop

__all__ = ["IMG_EXTENSIONS", "ImageFolder", "find_classes"]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def find_classes(root: str | Path) -> tuple[list[str], dict[str, int]]:
    """Class names (sorted sub-folders of ``root``) and their indices, as torchvision does."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    if not classes:
        raise FileNotFoundError(f"Couldn't find any class folder in {root}.")
    return classes, {name: i for i, name in enumerate(classes)}


def _check_on_error(on_error: str) -> str:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error should be 'raise' or 'skip', got {on_error!r}")
    return on_error


class ImageFolder(Dataset):
    """Images in ``root/<class>/**/<file>``, as torchvision's ``ImageFolder``, without it.

    Classes, ``class_to_idx``, ``samples`` and ``targets`` match torchvision's. Each item is
    ``(image, target)`` with ``image`` a uint8 ``3 × size × size`` (CHW, RGB) tensor: a
    random-resized crop (scale 0.08–1, ratio 3/4–4/3) and a horizontal flip when ``train``,
    else the central crop of ``crop_fraction`` of the short side. Only the crop window is
    decoded (see :mod:`fastfeed.vision.window_decode`). Collate with :class:`ImageCollate` (or
    ``default_collate``) to get a uint8 ``N × 3 × size × size`` batch.

    Args:
        root: the dataset folder.
        size: output side in pixels.
        train: random augmentation (True) or the evaluation crop (False).
        crop_fraction: evaluation crop as a share of the short side (224/256 by default).
        on_error: ``"raise"`` a :class:`DecodeError` naming the file, or ``"skip"`` the sample
            (counted in ``loader.stats().skipped_samples``).
        roi_decode: use the libjpeg-turbo window decoder when it is built.
    """

    def __init__(self, root: str | Path, size: int = 224, train: bool = True,
                 crop_fraction: float = 0.875, on_error: str = "raise",
                 roi_decode: bool = True) -> None:
        self.root = str(root)
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"ImageFolder: {self.root} is not a directory")
        self.size, self.train, self.crop_fraction = size, train, crop_fraction
        self.on_error = _check_on_error(on_error)
        self.roi_decode = roi_decode
        self.classes, self.class_to_idx = find_classes(self.root)
        self.samples: list[tuple[str, int]] = []
        for name in self.classes:
            for folder, _, files in sorted(os.walk(os.path.join(self.root, name),
                                                   followlinks=True)):
                for file in sorted(files):
                    if file.lower().endswith(IMG_EXTENSIONS):
                        self.samples.append((os.path.join(folder, file), self.class_to_idx[name]))
        empty = set(self.classes) - {self.classes[target] for _, target in self.samples}
        if empty:  # as torchvision's ImageFolder refuses them
            raise FileNotFoundError(f"Found no valid file for the classes "
                                    f"{', '.join(sorted(empty))}. Supported extensions are: "
                                    f"{', '.join(IMG_EXTENSIONS)}")
        self.targets = [target for _, target in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def _box(self, width: int, height: int) -> tuple[int, int, int, int]:
        if self.train:
            return random_resized_crop_box(width, height)
        return center_crop_box(width, height, self.crop_fraction)

    def __getitem__(self, index: int) -> Any:
        path, target = self.samples[index]
        try:
            with open(path, "rb") as f:
                data = f.read()
            image = decode_resized_crop(data, self._box, (self.size, self.size), path,
                                        self.roi_decode)
        except DecodeError:
            if self.on_error == "skip":
                return SKIP
            raise
        if self.train and random_flip():
            image = image.flip(-1)
        return image, target
