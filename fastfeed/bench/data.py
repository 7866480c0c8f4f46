"""``fastfeed bench --data ...``: resolve a data source into the datasets each config loads.

A source gives, per configuration, the dataset and collate function: the stock DataLoader gets
what a typical script would use (a plain Pillow dataset for images), FastLoader gets the same
(the drop-in) or fastfeed's image pipeline.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from fastfeed.vision import ImageCollate, ImageFolder, YoloCollate, YoloDataset
from fastfeed.vision.augment import letterbox_geometry, random_flip, random_resized_crop_box
from fastfeed.vision.folder import IMG_EXTENSIONS

__all__ = [
    "TORCHVISION_CONFIGS", "BenchError", "Source", "baseline", "beyond_loader", "changes",
    "changes_note", "classic_imagefolder", "resolve", "torchvision_available",
]

CACHE = Path(os.environ.get("FASTFEED_CACHE", Path.home() / ".cache" / "fastfeed"))


class BenchError(Exception):
    """Bad input: printed as one line, without a traceback."""


class SyntheticImages(Dataset):
    """Fixed-size uint8 3×size×size tensors (16 pre-made, cycled) and labels: cheap to index,
    so that the loader, not decoding, is what is measured."""

    def __init__(self, size: int = 224, classes: int = 1000, length: int = 100_000) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = [torch.randint(0, 256, (3, size, size), generator=g, dtype=torch.uint8)
                       for _ in range(16)]
        self.classes, self.length = classes, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i % 16], i % self.classes


class PlainPILFolder(Dataset):
    """The stock baseline: whole-image Pillow decode, random-resized crop, flip, CHW tensor."""

    def __init__(self, folder: ImageFolder) -> None:
        self.samples, self.size = folder.samples, folder.size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, target = self.samples[i]
        image = Image.open(path).convert("RGB")
        x, y, w, h = random_resized_crop_box(*image.size)
        image = image.resize((self.size, self.size), Image.Resampling.BILINEAR,
                             box=(x, y, x + w, y + h))
        if random_flip():
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(image)).permute(2, 0, 1).contiguous(), target


class PlainPILYolo(Dataset):
    """The stock detection baseline: whole-image decode, Pillow letterbox, flip."""

    def __init__(self, dataset: YoloDataset) -> None:
        self.files, self.size = dataset.im_files, dataset.imgsz

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        image = Image.open(self.files[i]).convert("RGB")
        _, new_w, new_h, left, top = letterbox_geometry(*image.size, self.size)
        canvas = Image.new("RGB", (self.size, self.size), (114, 114, 114))
        canvas.paste(image.resize((new_w, new_h), Image.Resampling.BILINEAR), (left, top))
        if random_flip():
            canvas = canvas.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(canvas)).permute(2, 0, 1).contiguous()


def torchvision_available() -> bool:
    """Whether torchvision imports against the installed torch."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # an ImportError, or a RuntimeError from a mismatched build
        return False
    return True


def classic_imagefolder(root: Path, accelerated: bool = False) -> Dataset:
    """What a torchvision ImageNet script trains on: ``ImageFolder`` with the classic
    transforms (RandomResizedCrop 224, flip, ToTensor, Normalize), optionally passed through
    :func:`fastfeed.vision.accelerate`."""
    from torchvision import datasets
    from torchvision import transforms as T

    from fastfeed.vision.accelerate import accelerate

    classic = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                         T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    dataset = datasets.ImageFolder(str(root), transform=classic)
    return accelerate(dataset) if accelerated else dataset


# The configurations over a user's own torchvision pipeline, each compared with the first.
TORCHVISION_CONFIGS = ("torchvision", "torchvision+swap", "torchvision+accelerate")


def baseline(config: str) -> str:
    """The stock configuration a configuration's speedup is measured against: ``dali`` runs
    NVIDIA's recipe, whose float output is torchvision's classic transforms'."""
    return "torchvision" if config.startswith("torchvision") or config == "dali" else "stock"


# What each configuration changes against its baseline, per kind of source (``"tensors"``,
# ``"classify"``, ``"detect"``), and how it does. A row that changes the dataset or the
# transforms too measures more than the loader: its speed-up is not the loader's alone.
_CHANGES: dict[str, dict[str, str]] = {
    "fastfeed": {"tensors": "loader", "classify": "loader, dataset, transforms",
                 "detect": "loader, dataset, transforms"},
    "fastfeed+device": {"tensors": "loader, GPU normalize",
                        "classify": "loader, dataset, transforms",
                        "detect": "loader, dataset, transforms"},
    "torchvision+swap": dict.fromkeys(("classify",), "loader"),
    "torchvision+accelerate": dict.fromkeys(("classify",), "loader, dataset"),
    "dali": dict.fromkeys(("classify",), "loader, dataset, transforms"),
}
_HOW = {
    "fastfeed": "fastfeed's window-decoding dataset and its own crop and flip, against a "
                "whole-image Pillow dataset",
    "torchvision+accelerate": "accelerate() of the same ImageFolder: the same transforms' "
                              "draws over a window decode",
    "dali": "NVIDIA's ResNet-50 recipe",
}


def changes(config: str, kind: str) -> str:
    """What ``config`` changes against its :func:`baseline` on a source of ``kind``."""
    return "baseline" if config == baseline(config) else _CHANGES[config][kind]


def beyond_loader(change: str) -> bool:
    """Whether a row that :func:`changes` describes so measures more than the loader."""
    return change not in ("baseline", "loader")


def changes_note(results: list[dict[str, Any]]) -> str | None:
    """One line under the table for the rows that change more than the loader, or ``None``."""
    beyond = [r["config"] for r in results if beyond_loader(r["changes"])]
    if not beyond:
        return None
    how = [f"{config}: {_HOW[config]}" for config in dict.fromkeys(beyond) if config in _HOW]
    return ("changes: rows that change the dataset or transforms as well as the loader "
            "measure more than the loader; their speed-up is not the loader's alone"
            + (f" ({'; '.join(how)})" if how else ""))


@dataclass
class Source:
    """What a configuration loads: ``datasets(config) -> (dataset, collate_fn or None)``."""

    kind: str  # "tensors", "classify" or "detect"
    description: str
    root: Path | None = None
    factory: Any = None

    def dataset(self, config: str, roi: bool = True) -> tuple[Dataset, Any]:
        if self.kind == "tensors":
            return self.factory(), None
        assert self.root is not None
        if config.startswith("torchvision"):
            return classic_imagefolder(self.root, config == "torchvision+accelerate"), None
        if self.kind == "classify":
            if config == "stock":
                return PlainPILFolder(ImageFolder(self.root)), None
            return ImageFolder(self.root, roi_decode=roi), ImageCollate()
        if config == "stock":
            return PlainPILYolo(YoloDataset(self.root)), None
        return YoloDataset(self.root), YoloCollate()


def _detect_layout(path: Path) -> str:
    if (path / "images").is_dir():
        return "detect"
    subdirs = [p for p in path.iterdir() if p.is_dir()]
    for sub in subdirs:
        if any(f.suffix.lower() in IMG_EXTENSIONS for f in sub.rglob("*")):
            return "classify"
    raise BenchError(f"{path}: neither an ImageFolder (class sub-folders of images) nor a YOLO "
                     "folder (images/ and labels/)")


def _module_dataset(spec: str) -> Source:
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise BenchError(f"--data {spec}: cannot import {module_name!r}: {error}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise BenchError(f"--data {spec}: {module_name} has no function {function_name!r}")
    try:
        probe = function()
    except Exception as error:
        raise BenchError(f"--data {spec}: {function_name}() raised {type(error).__name__}: "
                         f"{error}") from None
    if not isinstance(probe, Dataset):
        raise BenchError(f"--data {spec}: {function_name}() returned "
                         f"{type(probe).__name__}, not a torch Dataset")
    return Source("tensors", f"{spec}()", factory=function)


def resolve(data: str, images: int = 1000) -> Source:
    """Turn ``--data`` into a :class:`Source`, generating ``imagenet-like`` on first use."""
    if data == "synthetic":
        return Source("tensors", "synthetic uint8 3×224×224", factory=SyntheticImages)
    if data == "imagenet-like":
        from fastfeed.vision.synthetic import make_imagefolder

        root = CACHE / f"imagenet-like-{images}"
        if not root.exists():
            make_imagefolder(root.with_suffix(".partial"), images, classes=50)
            (root.with_suffix(".partial")).rename(root)
        return Source("classify", f"imagenet-like ({images} JPEGs, ~500×375)", root)
    path = Path(data).expanduser()
    if path.exists():
        if not path.is_dir():
            raise BenchError(f"--data {data}: not a directory")
        kind = _detect_layout(path)
        return Source(kind, f"{kind} folder {path}", path)
    if ":" in data and not data.startswith((".", "/", "~")):
        return _module_dataset(data)
    raise BenchError(f"--data {data}: no such directory (and not 'synthetic', "
                     "'imagenet-like' or 'module:function')")
