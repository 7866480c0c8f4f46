"""``accelerate``: speed up a user's own torchvision ``ImageFolder`` without changing it.

A classic torchvision pipeline decodes the whole JPEG with Pillow, then crops and resizes it.
:func:`accelerate` recognises the common transforms and runs the same pipeline the fast way:
the crop windows and flips come from the *user's transform objects* with torchvision's own
random draws, in the same order, so labels, order and augmentation parameters equal the
stock pipeline's for the same seed. Only the pixels are made differently: just the window of
the JPEG is decoded, at the coarsest DCT scale that keeps it at least the output size, then
resized with torch's antialiased bilinear uint8 kernel (:mod:`fastfeed.vision.decode`), a
few grey levels from Pillow's result.

The plan is compiled once, from the transform objects, into :class:`FusedTransform`:

- geometry (``RandomResizedCrop``, ``Resize``, ``CenterCrop``, ``RandomHorizontalFlip``) is
  folded into one source window, one output size and a flip;
- the conversion (``ToTensor``, ``PILToTensor``, ``ToImage``) turns the uint8 CHW result into
  what that transform returns;
- the tail (``ToDtype``, ``ConvertImageDtype``, ``Normalize``) is the user's own objects, run
  on that tensor: the same ops in the same order.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from fastfeed.vision.decode import Box, decode_resized_crop, image_size
from fastfeed.vision.folder import ImageFolder

__all__ = [
    "BatchTail", "EncodedImage", "FusedTransform", "UnsupportedPipeline", "accelerate",
    "batch_tail", "read_encoded",
]

_GEOMETRY = ("RandomResizedCrop", "Resize", "CenterCrop", "RandomHorizontalFlip")
_CONVERSIONS = ("ToTensor", "PILToTensor", "ToImage")
_TAIL = ("ToDtype", "ConvertImageDtype", "Normalize")


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


class UnsupportedPipeline(ValueError):
    """The dataset or transform holds something :func:`accelerate` cannot reproduce."""


# --------------------------------------------------------------------------- compile


def _flatten(transform: Any) -> list[Any]:
    inner = getattr(transform, "transforms", None)
    if type(transform).__name__ == "Compose" and isinstance(inner, Sequence):
        return [t for child in inner for t in _flatten(child)]
    return [transform]


def _kind(transform: Any) -> str:
    """The class name, if it is torchvision's own class (v1 or v2); else ``""``."""
    cls = type(transform)
    if not cls.__module__.startswith("torchvision.transforms"):
        return ""
    return cls.__name__


def _is_bilinear(interpolation: Any) -> bool:
    """torchvision keeps an ``InterpolationMode``, its string value, or a Pillow constant."""
    if isinstance(interpolation, int):
        return interpolation == Image.Resampling.BILINEAR
    return str(getattr(interpolation, "value", interpolation)) == "bilinear"


def _check_bilinear_antialiased(transform: Any, name: str) -> None:
    if not _is_bilinear(transform.interpolation):
        raise UnsupportedPipeline(f"{name}(interpolation={transform.interpolation})")
    if getattr(transform, "antialias", True) is False:
        raise UnsupportedPipeline(f"{name}(antialias=False)")


def _check_geometry(transform: Any, name: str) -> None:
    if name in ("RandomResizedCrop", "Resize"):
        _check_bilinear_antialiased(transform, name)
    if name == "Resize" and transform.size is None:
        raise UnsupportedPipeline("Resize(size=None)")


@dataclass
class _Plan:
    geometry: list[tuple[str, Any]]
    conversion: str
    tail: list[Any]


def _compile(transform: Any) -> _Plan:
    """Split a transform into geometry, conversion and tail, or raise
    :class:`UnsupportedPipeline` naming the first piece that does not fit."""
    if transform is None:
        raise UnsupportedPipeline("transform=None (the dataset returns PIL images)")
    geometry: list[tuple[str, Any]] = []
    conversion = ""
    tail: list[Any] = []
    for piece in _flatten(transform):
        name = _kind(piece)
        if name in _GEOMETRY and not tail:
            _check_geometry(piece, name)
            geometry.append((name, piece))
        elif name in _CONVERSIONS and not conversion:
            conversion = name
        elif name in _TAIL and conversion:
            tail.append(piece)
        else:
            raise UnsupportedPipeline(repr(piece).replace("\n", " "))
    if not conversion:
        raise UnsupportedPipeline(f"{transform!r} returns PIL images (no ToTensor, PILToTensor "
                                  "or ToImage)".replace("\n", " "))
    return _Plan(geometry, conversion, tail)


# --------------------------------------------------------------------------- geometry


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


class _Window:
    """The current image as a rectangle of the source (float pixels), its size, and whether
    it is mirrored."""

    def __init__(self, width: int, height: int) -> None:
        self.x, self.y, self.w, self.h = 0.0, 0.0, float(width), float(height)
        self.width, self.height = width, height
        self.flipped = False

    def crop(self, left: int, top: int, width: int, height: int) -> None:
        scale_x, scale_y = self.w / self.width, self.h / self.height
        if self.flipped:  # the current image's left is the source window's right
            left = self.width - left - width
        self.x += left * scale_x
        self.y += top * scale_y
        self.w, self.h = width * scale_x, height * scale_y
        self.width, self.height = width, height

    def resize(self, width: int, height: int) -> None:
        self.width, self.height = width, height

    def source_box(self, image_width: int, image_height: int) -> Box:
        left, top = round(self.x), round(self.y)
        right = min(image_width, max(left + 1, round(self.x + self.w)))
        bottom = min(image_height, max(top + 1, round(self.y + self.h)))
        return left, top, right - left, bottom - top


def _size_stub(width: int, height: int) -> torch.Tensor:
    """A 3×H×W tensor without memory: what torchvision's ``get_params`` reads sizes from."""
    return torch.empty((), dtype=torch.uint8).expand(3, height, width)


def _random_resized_crop(transform: Any, width: int, height: int) -> tuple[int, int, int, int]:
    """(left, top, width, height) drawn by torchvision's own code for this transform."""
    stub = _size_stub(width, height)
    if hasattr(transform, "make_params"):  # v2
        params = transform.make_params([stub])
        return params["left"], params["top"], params["width"], params["height"]
    top, left, h, w = transform.get_params(stub, transform.scale, transform.ratio)
    return left, top, w, h


def _needs_padding(geometry: list[tuple[str, Any]], width: int, height: int) -> bool:
    """Whether a ``CenterCrop`` would pad. Sizes do not depend on the random draws, so this
    is known before any is made."""
    for name, transform in geometry:
        if name == "RandomResizedCrop":
            width, height = _pair(transform.size)
        elif name == "Resize":
            width, height = _resized_size(transform.size, transform.max_size, width, height)
        elif name == "CenterCrop":
            crop_w, crop_h = _pair(transform.size)
            if crop_w > width or crop_h > height:
                return True
            width, height = crop_w, crop_h
    return False


# --------------------------------------------------------------------------- transforms


def _to_tensor(image: torch.Tensor, conversion: str) -> torch.Tensor:
    """uint8 CHW to what ``conversion`` returns for the equivalent PIL image."""
    if conversion == "ToTensor":  # the same cast and division as torchvision's to_tensor
        return image.to(dtype=torch.get_default_dtype()).div(255)
    if conversion == "ToImage":
        from torchvision import tv_tensors

        return tv_tensors.Image(image)
    return image


class FusedTransform:
    """The user's transform, run from encoded bytes: window decode, the same random draws.

    Args:
        original: the user's transform (kept for repr and for samples that must take the
            stock path: a ``CenterCrop`` that pads).
        plan: what :func:`accelerate` compiled from it.
        defer_tail: stop at uint8 CHW; :class:`BatchTail` finishes each batch on the device.
    """

    def __init__(self, original: Any, plan: _Plan, defer_tail: bool = False) -> None:
        self.original = original
        self.plan = plan
        self.defer_tail = defer_tail

    def __repr__(self) -> str:
        inner = repr(self.original).replace("\n", "\n    ")
        return f"FusedTransform(\n    {inner}\n)"

    def __call__(self, encoded: EncodedImage) -> Any:
        if not isinstance(encoded, EncodedImage):
            raise TypeError("FusedTransform takes what fastfeed's read_encoded returns, got "
                            f"{type(encoded).__name__}: keep the dataset's loader")
        width, height = image_size(encoded.data, encoded.path)
        if _needs_padding(self.plan.geometry, width, height):
            return self.original(encoded.to_pil())
        window = _Window(width, height)
        for name, transform in self.plan.geometry:
            if name == "RandomResizedCrop":
                window.crop(*_random_resized_crop(transform, window.width, window.height))
                window.resize(*_pair(transform.size))
            elif name == "Resize":
                window.resize(*_resized_size(transform.size, transform.max_size,
                                             window.width, window.height))
            elif name == "CenterCrop":
                crop_w, crop_h = _pair(transform.size)
                window.crop(*_center_crop_offsets(window.width, window.height, crop_w, crop_h),
                            crop_w, crop_h)
            elif float(torch.rand(1)) < transform.p:  # RandomHorizontalFlip: torchvision's draw
                window.flipped = not window.flipped
        box = window.source_box(width, height)
        image = decode_resized_crop(encoded.data, lambda _w, _h: box,
                                    (window.width, window.height), encoded.path)
        if window.flipped:
            image = image.flip(-1)
        if self.defer_tail:
            return image
        return _apply_tail(image, self.plan)


def _apply_tail(images: torch.Tensor, plan: _Plan) -> Any:
    out = _to_tensor(images, plan.conversion)
    for transform in plan.tail:
        out = transform(out)
    return out


class BatchTail:
    """The conversion and tail of a deferred :class:`FusedTransform`, on a whole batch:
    a ``gpu_transform`` for :class:`~fastfeed.FastLoader`. The images (the first element of
    the batch) cross to the device as uint8, four times fewer bytes than float32; the ops are
    the same, elementwise, so the values equal the per-sample pipeline's."""

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan

    def __call__(self, batch: Any) -> Any:
        images, *rest = batch
        return type(batch)([_apply_tail(images, self.plan), *rest])


# --------------------------------------------------------------------------- entry point


def _check_dataset(dataset: Any) -> None:
    try:
        from torchvision import get_image_backend
        from torchvision.datasets import DatasetFolder
        from torchvision.datasets.folder import default_loader, pil_loader
    except ImportError:
        raise UnsupportedPipeline(f"{type(dataset).__name__} (torchvision is not installed)")\
            from None
    if not isinstance(dataset, DatasetFolder):
        raise UnsupportedPipeline(f"{type(dataset).__name__} (not a torchvision DatasetFolder)")
    if type(dataset).__getitem__ is not DatasetFolder.__getitem__:
        raise UnsupportedPipeline(f"{type(dataset).__name__}.__getitem__ (overridden)")
    if dataset.loader not in (default_loader, pil_loader):
        raise UnsupportedPipeline(f"loader={getattr(dataset.loader, '__name__', dataset.loader)}")
    if dataset.loader is default_loader and get_image_backend() != "PIL":
        raise UnsupportedPipeline(f"image backend {get_image_backend()!r}")


def accelerate(dataset: Dataset, *, defer_tail: bool = False) -> Dataset:
    r"""Return a faster copy of a torchvision ``ImageFolder``/``DatasetFolder``.

    The copy is the same class with the same ``classes``, ``class_to_idx``, ``samples``,
    ``targets``, ``target_transform`` and length; only its ``loader`` (which now reads bytes)
    and ``transform`` (a :class:`FusedTransform` of the user's one) change. Items have the
    dtype, shape and normalisation the user's transform gives, and the same random crop
    windows and flips for the same seed; pixels differ from Pillow's by a few grey levels.

    Recognised: the default PIL loader, and a transform (v1 or v2, ``Compose`` or single) made
    of ``RandomResizedCrop``, ``Resize``, ``CenterCrop`` and ``RandomHorizontalFlip`` (bilinear,
    antialiased), then ``ToTensor``, ``PILToTensor`` or ``ToImage``, then ``ToDtype``,
    ``ConvertImageDtype`` and ``Normalize``. Anything else gives one warning naming the first
    piece that does not fit, and the dataset is returned unchanged: the data never silently
    differs. A :class:`fastfeed.vision.ImageFolder` is already fast and is returned as is.

    Args:
        dataset: the user's dataset.
        defer_tail (bool): items stop at uint8 CHW; pass :func:`batch_tail` of the result as
            ``FastLoader(..., device="cuda", gpu_transform=...)`` to convert and normalise each
            batch on the copy stream (a quarter of the bytes cross PCIe; identical values).

    Example:
        >>> train = torchvision.datasets.ImageFolder("imagenet/train", transform=classic)
        >>> train = fastfeed.vision.accelerate(train)
        >>> loader = FastLoader(train, batch_size=256, shuffle=True, num_workers=8)
    """
    if isinstance(dataset, ImageFolder):
        return dataset
    try:
        _check_dataset(dataset)
        plan = _compile(dataset.transform)  # type: ignore[attr-defined]
    except UnsupportedPipeline as unsupported:
        warnings.warn(f"fastfeed.vision.accelerate: {unsupported} is not supported; the dataset "
                      "runs unchanged", stacklevel=2)
        return dataset
    fast = copy.copy(dataset)
    fast.loader = read_encoded  # type: ignore[attr-defined]
    fast.transform = FusedTransform(dataset.transform, plan,  # type: ignore[attr-defined]
                                    defer_tail)
    return fast


def batch_tail(dataset: Dataset) -> Callable[[Any], Any]:
    """The :class:`BatchTail` of a dataset accelerated with ``defer_tail=True``."""
    transform = getattr(dataset, "transform", None)
    if not isinstance(transform, FusedTransform) or not transform.defer_tail:
        raise ValueError("batch_tail needs a dataset from accelerate(..., defer_tail=True)")
    return BatchTail(transform.plan)
