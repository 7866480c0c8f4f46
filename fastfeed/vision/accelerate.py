"""``accelerate``: speed up a user's own torchvision ``ImageFolder`` without changing it.

A classic torchvision pipeline decodes the whole JPEG with Pillow, then crops and resizes it.
:func:`accelerate` recognises the pipeline's leading crop and resize and runs that *prefix* the
fast way: the crop windows and flips come from the *user's transform objects* with their own
random draws (torchvision's from torch's generator, timm's from Python's ``random``), in the
same order, so labels, order and augmentation parameters equal the stock pipeline's for the
same seed. Only the pixels are made differently: just the window of the JPEG is decoded, at the
coarsest DCT scale that keeps it at least the output size, then resized with torch's
antialiased uint8 kernel (:mod:`fastfeed.vision.decode`), a few grey levels from Pillow's result.

The plan is compiled once, from the transform objects, into :class:`FusedTransform`:

- the prefix's geometry (``RandomResizedCrop``, timm's ``RandomResizedCropAndInterpolation``,
  ``Resize``, ``CenterCrop``, ``RandomHorizontalFlip``) is folded into one source window, one
  output size and a flip;
- a conversion in the prefix (``ToTensor``, ``PILToTensor``, ``ToImage``, timm's
  ``MaybeToTensor``, ``MaybePILToTensor``, ``ToTensor`` and ``ToNumpy``) turns the uint8 CHW
  result into what that transform returns; without one, the result becomes the PIL image the
  stock prefix would have returned;
- the *tail*, everything after the prefix (``Normalize``, ``ColorJitter``, RandAugment,
  ``RandomErasing``, anything), is the user's own objects, run in order on that object, so they
  make the same random draws as in the stock pipeline.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import io
import random
import textwrap
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from fastfeed._copy import stack_into
from fastfeed._torch_compat import default_collate
from fastfeed.collate import stackable
from fastfeed.tail import BatchTailSplit
from fastfeed.vision.decode import Box, decode_resized_crop, image_size
from fastfeed.vision.folder import ImageFolder

__all__ = [
    "BatchTail", "EncodedImage", "FusedTransform", "TailCollate", "UnsupportedPipeline",
    "accelerate", "batch_tail", "deferred_for_device", "read_encoded",
]

_TIMM_RRC = "timm.RandomResizedCropAndInterpolation"
_CROPS = ("RandomResizedCrop", _TIMM_RRC)
_GEOMETRY = (*_CROPS, "Resize", "CenterCrop", "RandomHorizontalFlip")
_RESIZES = (*_CROPS, "Resize")
# The reduced DCT scale keeps the decoded window at twice the output size, not once: at 1x,
# RandomResizedCrop(224) of sharp photos differed from the user's Pillow pipeline by 0.51 grey
# levels on average (13 % of images above 2, single pixels by 105); at 2x by 0.02 (the worst
# image 0.21), with no loss of speed measured on ImageNet-sized JPEGs (2000 of them, 2 workers:
# 2,360-2,393 images/s at 1x, 2,393-2,452 at 2x).
_DCT_MARGIN = 2
# Conversions from a PIL image, and what each gives for the equivalent uint8 CHW tensor.
_TO_FLOAT = ("ToTensor", "timm.MaybeToTensor")  # float in [0, 1]
_TO_UINT8 = ("PILToTensor", "timm.MaybePILToTensor")
_CONVERSIONS = (*_TO_FLOAT, *_TO_UINT8, "ToImage", "timm.ToTensor", "timm.ToNumpy")
# Tail pieces that are elementwise on a tensor: they can run on a whole batch, on the device.
_BATCHABLE = ("ToDtype", "ConvertImageDtype", "Normalize", "ToPureTensor")
_RESAMPLING = {Image.Resampling.BILINEAR: "bilinear", Image.Resampling.BICUBIC: "bicubic"}


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


def _delegates_to_transforms(transform: Any) -> bool:
    """Whether calling ``transform`` only calls its ``.transforms``: torchvision's reference
    presets (``ClassificationPresetTrain``/``Eval``) and wrappers like them. Read from the
    source of ``__call__``, so a wrapper that does anything more is not taken apart."""
    if not callable(getattr(transform, "transforms", None)):
        return False
    try:
        source = textwrap.dedent(inspect.getsource(type(transform).__call__))
        function = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):  # no source: a builtin, a REPL
        return False
    if not isinstance(function, ast.FunctionDef) or len(function.args.args) != 2:
        return False
    body = [statement for statement in function.body  # without the docstring
            if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant))]
    self_name, image_name = (arg.arg for arg in function.args.args)
    expected = ast.parse(f"return {self_name}.transforms({image_name})").body[0]
    return len(body) == 1 and ast.dump(body[0]) == ast.dump(expected)


def _flatten(transform: Any) -> list[Any]:
    inner = getattr(transform, "transforms", None)
    if type(transform).__name__ == "Compose" and isinstance(inner, Sequence):
        return [t for child in inner for t in _flatten(child)]
    if _delegates_to_transforms(transform):
        return _flatten(inner)
    return [transform]


def _kind(transform: Any) -> str:
    """The class name for torchvision's own classes (v1 or v2), ``timm.``-prefixed for timm's
    (timm's ``ToTensor`` does not scale); ``""`` for anything else."""
    cls = type(transform)
    if cls.__module__.startswith("torchvision.transforms"):
        return cls.__name__
    if cls.__module__.startswith("timm.data"):
        return f"timm.{cls.__name__}"
    return ""


def _mode(interpolation: Any) -> str | None:
    """``"bilinear"``/``"bicubic"`` for an ``InterpolationMode``, its string value or a Pillow
    constant (torchvision keeps any of them); ``None`` for modes fastfeed does not resize with."""
    if isinstance(interpolation, int):
        return _RESAMPLING.get(interpolation)  # type: ignore[call-overload]
    value = str(getattr(interpolation, "value", interpolation))
    return value if value in ("bilinear", "bicubic") else None


def _geometry_problem(transform: Any, name: str) -> str | None:
    """Why this geometry piece cannot be folded into the window, or ``None``."""
    if name in ("RandomResizedCrop", "Resize", _TIMM_RRC):
        modes = transform.interpolation
        for mode in modes if isinstance(modes, (tuple, list)) else [modes]:
            if _mode(mode) is None:
                return f"{name}(interpolation={mode})"
        if getattr(transform, "antialias", True) is False:
            return f"{name}(antialias=False)"
    if name == "Resize" and transform.size is None:
        return "Resize(size=None)"
    if name == "Resize" and getattr(transform, "max_size", None) is not None:
        # torchvision refuses these on every image; the user's object will say so.
        size = transform.size
        shorter = size if isinstance(size, int) else size[0] if len(size) == 1 else None
        if shorter is None or transform.max_size <= shorter:
            return f"Resize(size={size}, max_size={transform.max_size})"
    return None


@dataclass
class _Plan:
    """A pipeline split into the prefix fastfeed runs and the tail the user's objects run.

    ``conversion`` is the prefix's ``(kind, object)`` conversion, ``None`` when the tail gets
    a PIL image."""

    geometry: list[tuple[str, Any]]
    conversion: tuple[str, Any] | None
    tail: list[Any]

    def per_sample_piece(self) -> str | None:
        """What keeps the tail from running on whole batches (named), or ``None``."""
        if self.conversion is None:
            return "a PIL image output"
        if self.conversion[0] == "timm.ToNumpy":
            return "ToNumpy"
        return next((_describe(t) for t in self.tail if _kind(t) not in _BATCHABLE), None)


def _describe(piece: Any) -> str:
    return repr(piece).replace("\n", " ")


def _compile(transform: Any) -> _Plan:
    """Split a transform into the longest prefix fastfeed reproduces and the user's tail, or
    raise :class:`UnsupportedPipeline` naming the first piece when the prefix is empty."""
    if transform is None:
        raise UnsupportedPipeline("transform=None (the dataset returns PIL images)")
    pieces = _flatten(transform)
    if not pieces:
        raise UnsupportedPipeline("an empty transform")
    geometry: list[tuple[str, Any]] = []
    conversion: tuple[str, Any] | None = None
    prefix = 0
    for piece in pieces:
        name = _kind(piece)
        # Geometry after ToNumpy would fail in the stock pipeline too: left to the tail.
        geometry_ok = conversion is None or conversion[0] != "timm.ToNumpy"
        # One resize at most: two resample twice (Resize(32) then Resize(224) is blurred),
        # which one resize from the source window cannot reproduce.
        if name in _RESIZES and any(taken in _RESIZES for taken, _ in geometry):
            break
        if name in _GEOMETRY and geometry_ok and _geometry_problem(piece, name) is None:
            geometry.append((name, piece))
        elif name in _CONVERSIONS and conversion is None:
            conversion = (name, piece)
        else:
            break
        prefix += 1
    if not geometry and conversion is None:
        first = pieces[0]
        raise UnsupportedPipeline(_geometry_problem(first, _kind(first)) or _describe(first))
    return _Plan(geometry, conversion, pieces[prefix:])


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
    """The current image as a rectangle of the source (float pixels), its size, whether it is
    mirrored, and the interpolation of the last resize."""

    def __init__(self, width: int, height: int) -> None:
        self.x, self.y, self.w, self.h = 0.0, 0.0, float(width), float(height)
        self.width, self.height = width, height
        self.flipped = False
        self.mode = "bilinear"

    def crop(self, left: int, top: int, width: int, height: int) -> None:
        scale_x, scale_y = self.w / self.width, self.h / self.height
        if self.flipped:  # the current image's left is the source window's right
            left = self.width - left - width
        self.x += left * scale_x
        self.y += top * scale_y
        self.w, self.h = width * scale_x, height * scale_y
        self.width, self.height = width, height

    def resize(self, size: tuple[int, int], interpolation: Any) -> None:
        mode = _mode(interpolation)
        assert mode is not None, "_compile lets only bilinear and bicubic resizes through"
        self.width, self.height = size
        self.mode = mode

    def source_box(self, image_width: int, image_height: int) -> Box:
        left, top = round(self.x), round(self.y)
        right = min(image_width, max(left + 1, round(self.x + self.w)))
        bottom = min(image_height, max(top + 1, round(self.y + self.h)))
        return left, top, right - left, bottom - top


def _size_stub(width: int, height: int) -> torch.Tensor:
    """A 3×H×W tensor without memory: what ``get_params`` reads sizes from."""
    return torch.empty((), dtype=torch.uint8).expand(3, height, width)


def _random_resized_crop(name: str, transform: Any, width: int, height: int
                         ) -> tuple[Box, Any]:
    """((left, top, width, height), interpolation) drawn by the transform's own code: torch's
    generator for torchvision's, Python's ``random`` for timm's (the window, then the
    interpolation when it is ``"random"``), in that library's order."""
    stub = _size_stub(width, height)
    if name == _TIMM_RRC:
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


def _needs_padding(geometry: list[tuple[str, Any]], width: int, height: int) -> bool:
    """Whether a ``CenterCrop`` would pad. Sizes do not depend on the random draws, so this
    is known before any is made."""
    for name, transform in geometry:
        if name in _CROPS:
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


@functools.cache
def _divisor_255(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """255 as a tensor on the images' device, made once per device (no host-to-device copy
    per batch). CUDA divides by a Python number as a multiply by its reciprocal, which differs
    from the CPU's true division (torchvision's ``ToTensor``) in the last bit of half of the
    values x/255; dividing by a tensor is a true division on every device."""
    return torch.tensor(255, dtype=dtype, device=device)


def _convert(images: torch.Tensor, conversion: tuple[str, Any] | None) -> Any:
    """uint8 CHW (or a batch of them) to what the prefix's conversion returns for the
    equivalent PIL image; without a conversion, that PIL image (RGB, as the stock prefix
    gives)."""
    if conversion is None:  # merging the planes is several times faster than making HWC
        return Image.merge("RGB", [Image.fromarray(plane) for plane in images.numpy()])
    kind, transform = conversion
    if kind in _TO_FLOAT:  # torchvision's to_tensor's cast and division (in place: one tensor)
        converted = images.to(dtype=torch.get_default_dtype())
        return converted.div_(_divisor_255(converted.device, converted.dtype))
    if kind == "ToImage":
        from torchvision import tv_tensors

        return tv_tensors.Image(images)
    if kind == "timm.ToTensor":  # pil_to_tensor, then a cast without scaling
        return images.to(dtype=transform.dtype)
    if kind == "timm.ToNumpy":
        return images.numpy()
    return images  # PILToTensor, MaybePILToTensor


def _run(transforms: Sequence[Callable[[Any], Any]], image: Any) -> Any:
    for transform in transforms:
        image = transform(image)
    return image


class FusedTransform:
    """The user's transform, run from encoded bytes: the prefix by window decode, the tail by
    the user's objects; the same random draws in the same order.

    Args:
        original: the user's transform (kept for repr and for samples that must take the
            stock path: a ``CenterCrop`` that pads).
        plan: what :func:`accelerate` compiled from it.
        defer_tail: stop at uint8 CHW; :class:`BatchTail` finishes each batch on the device
            (only for a tail of elementwise tensor ops).
    """

    def __init__(self, original: Any, plan: _Plan, defer_tail: bool = False) -> None:
        self.original = original
        self.plan = plan
        self.defer_tail = defer_tail
        self.tail = _tail_ops(plan.tail)

    def __repr__(self) -> str:
        inner = repr(self.original).replace("\n", "\n    ")
        return f"FusedTransform(\n    {inner}\n)"

    def _window(self, width: int, height: int) -> _Window:
        """The prefix's geometry, folded into one window with the transforms' own draws."""
        window = _Window(width, height)
        for name, transform in self.plan.geometry:
            if name in _CROPS:
                box, interpolation = _random_resized_crop(name, transform, window.width,
                                                          window.height)
                window.crop(*box)
                window.resize(_pair(transform.size), interpolation)
            elif name == "Resize":
                window.resize(_resized_size(transform.size, transform.max_size, window.width,
                                            window.height), transform.interpolation)
            elif name == "CenterCrop":
                crop_w, crop_h = _pair(transform.size)
                window.crop(*_center_crop_offsets(window.width, window.height, crop_w, crop_h),
                            crop_w, crop_h)
            elif float(torch.rand(1)) < transform.p:  # RandomHorizontalFlip: torchvision's draw
                window.flipped = not window.flipped
        return window

    def split_batch_tail(self, dataset: Dataset) -> BatchTailSplit | None:
        """The :mod:`fastfeed.tail` hook: ``dataset`` (whose transform this is) with items
        stopped at uint8, and the tail that finishes its batches (see
        :func:`deferred_for_device`)."""
        deferred = deferred_for_device(dataset)
        if deferred is None:
            return None
        dataset, tail = deferred
        return BatchTailSplit(dataset, tail, TailCollate(tail))

    def __call__(self, encoded: EncodedImage) -> Any:
        if not isinstance(encoded, EncodedImage):
            raise TypeError("FusedTransform takes what fastfeed's read_encoded returns, got "
                            f"{type(encoded).__name__}: keep the dataset's loader")
        width, height = image_size(encoded.data, encoded.path)
        if _needs_padding(self.plan.geometry, width, height):
            if self.defer_tail:  # the stock geometry (its draws, its padding), as uint8 CHW
                image = _run([t for _, t in self.plan.geometry], encoded.to_pil())
                return torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()
            return self.original(encoded.to_pil())
        window = self._window(width, height)
        box = window.source_box(width, height)
        image = decode_resized_crop(encoded.data, lambda _w, _h: box,
                                    (window.width, window.height), encoded.path,
                                    mode=window.mode, dct_margin=_DCT_MARGIN)
        if window.flipped:
            image = image.flip(-1)
        if self.defer_tail:
            return image
        return _run(self.tail, _convert(image, self.plan.conversion))


class _FloatFromPIL:
    """torchvision's ``ToTensor`` (or timm's ``MaybeToTensor``) in the tail, on the RGB PIL
    image a PIL augmentation returns: the same values, from the image's planes (several times
    faster than its transposing copy). Anything else goes to the user's object."""

    def __init__(self, to_tensor: Any) -> None:
        self.to_tensor = to_tensor

    def __call__(self, image: Any) -> Any:
        if not isinstance(image, Image.Image) or image.mode != "RGB":
            return self.to_tensor(image)
        planes = np.stack([np.asarray(plane) for plane in image.split()])
        return torch.from_numpy(planes).to(dtype=torch.get_default_dtype()).div_(255)


class _Normalize:
    """torchvision's ``Normalize`` (v1 or v2), with the same values, without its per-call
    cost: ``mean`` and ``std`` are made once per device and dtype (not copied from the host at
    every call), and checked for zeros on the host then (not with ``(std == 0).any()``, a
    device sync on a GPU, at every call)."""

    def __init__(self, normalize: Any) -> None:
        self.mean, self.std = normalize.mean, normalize.std
        self._on_device: dict[tuple[torch.device, torch.dtype],
                              tuple[torch.Tensor, torch.Tensor]] = {}

    def _statistics(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (images.device, images.dtype)
        if key not in self._on_device:
            mean = torch.as_tensor(self.mean, dtype=images.dtype)
            std = torch.as_tensor(self.std, dtype=images.dtype)
            if bool((std == 0).any()):
                raise ValueError(f"std evaluated to zero after conversion to {images.dtype}, "
                                 "leading to division by zero.")
            self._on_device[key] = (mean.view(-1, 1, 1).to(images.device),
                                    std.view(-1, 1, 1).to(images.device))
        return self._on_device[key]

    def __call__(self, images: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        if not images.is_floating_point():
            raise TypeError(f"Input tensor should be a float tensor. Got {images.dtype}.")
        mean, std = self._statistics(images)
        # torchvision: clone, sub_, div_: the same values
        out = (images.sub_(mean) if inplace else images.sub(mean)).div_(std)
        if type(images) is torch.Tensor:
            return out
        from torchvision import tv_tensors  # v2 keeps the input's TVTensor type

        return tv_tensors.wrap(out, like=images)


class _ToFloat:
    """torchvision's (v1) ``ConvertImageDtype`` to a float dtype, on uint8 images: the same
    true division by 255, by a tensor. torchvision divides by a Python number, which CUDA
    computes as a multiply by the reciprocal: not the per-sample (CPU) values."""

    def __init__(self, convert: Any) -> None:
        self.convert = convert
        self.dtype: torch.dtype = convert.dtype

    def __call__(self, image: Any) -> Any:
        if (type(image) is not torch.Tensor or image.dtype != torch.uint8
                or not self.dtype.is_floating_point):
            return self.convert(image)
        converted = image.to(self.dtype)
        return converted.div_(_divisor_255(converted.device, converted.dtype))


def _tail_ops(tail: list[Any]) -> list[Callable[[Any], Any]]:
    """The user's tail, with the pieces that have a same-valued faster (or device-safe) form
    swapped for it."""
    ops: list[Callable[[Any], Any]] = []
    for transform in tail:
        kind = _kind(transform)
        if kind == "Normalize":
            ops.append(_Normalize(transform))
        elif kind in _TO_FLOAT:
            ops.append(_FloatFromPIL(transform))
        elif kind == "ConvertImageDtype" and type(transform).__module__.endswith(
                "transforms.transforms"):  # v1; v2 multiplies, the same on every device
            ops.append(_ToFloat(transform))
        else:
            ops.append(transform)
    return ops


class BatchTail:
    """The conversion and tail of a deferred :class:`FusedTransform`, on a whole batch:
    a ``gpu_transform`` for :class:`~fastfeed.FastLoader`. The images (the first element of
    the batch) cross to the device as uint8, four times fewer bytes than float32; the ops are
    the same, elementwise, so the values equal the per-sample pipeline's. ``Normalize`` runs
    without a host sync or a host-to-device copy per batch (:class:`_Normalize`)."""

    def __init__(self, plan: _Plan) -> None:
        self.conversion = plan.conversion
        self.ops = _tail_ops(plan.tail)
        self._float_start = self._find_float_start()

    def __call__(self, batch: Any) -> Any:
        images, *rest = batch
        images = _run(self.ops, _convert(images, self.conversion))
        if isinstance(images, torch.Tensor) and type(images) is not torch.Tensor:
            # default_collate stacks tv_tensors (ToImage's) into a plain tensor
            images = images.as_subclass(torch.Tensor)
        return type(batch)([images, *rest])

    def _find_float_start(self) -> tuple[torch.dtype, list[Callable[[Any], Any]]] | None:
        """``(dtype, the ops after it)`` when the tail starts by dividing the uint8 images by
        255 into floats (``ToTensor``; ``PILToTensor`` then ``ConvertImageDtype``)."""
        if self.conversion is not None and self.conversion[0] in _TO_FLOAT:
            return torch.get_default_dtype(), self.ops
        if (self.conversion is not None and self.conversion[0] in _TO_UINT8 and self.ops
                and isinstance(self.ops[0], _ToFloat) and self.ops[0].dtype.is_floating_point):
            return self.ops[0].dtype, self.ops[1:]
        return None

    @property
    def converts_to_float(self) -> bool:
        """Whether :meth:`into` can run: the tail starts with a uint8 to float division."""
        return self._float_start is not None

    def into(self, images: torch.Tensor, empty: Callable[[tuple[int, ...], torch.dtype],
                                                         torch.Tensor]) -> Any:
        """The tail of the uint8 ``images``, computed in memory from ``empty`` (a ring slot's
        allocator) with no float batch in between: the conversion writes there, and
        ``Normalize`` works in place. The same values as :meth:`__call__` on ``images``.
        Needs :attr:`converts_to_float`."""
        assert self._float_start is not None
        dtype, ops = self._float_start
        result: Any = empty(tuple(images.shape), dtype)
        result.copy_(images).div_(_divisor_255(result.device, result.dtype))
        owned = result
        for op in ops:
            if isinstance(op, _Normalize) and result is owned:
                result = op(result, inplace=True)
            else:
                result = op(result)
        return result


class TailCollate:
    """``default_collate``, then a :class:`BatchTail`: how :class:`~fastfeed.FastLoader`
    collates an accelerated dataset whose tail runs on whole batches.

    The items stop at uint8 (a quarter of the bytes of float32). In a worker,
    :meth:`collate_into` stacks them once into a private buffer, then computes the float batch
    straight into the ring slot: the per-sample pipeline would allocate, fault in and write a
    float tensor per image, then copy the batch again at collate. Values equal the per-sample
    pipeline's, and the structure equals ``default_collate``'s.
    """

    def __init__(self, tail: BatchTail) -> None:
        self.tail = tail
        self._staging: torch.Tensor | None = None  # per process: workers each unpickle a copy

    def __call__(self, samples: list) -> Any:
        return self.tail(default_collate(samples))

    def __getstate__(self) -> dict[str, Any]:
        return {"tail": self.tail, "_staging": None}

    def collate_into(self, samples: list,
                     empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> Any:
        """Collate ``samples`` (``(uint8 image, target, ...)`` tuples) with the float images
        allocated by ``empty``; anything else takes :meth:`__call__`."""
        first = samples[0] if samples else None
        if not (self.tail.converts_to_float and isinstance(first, tuple)
                and all(type(s) is tuple and len(s) == len(first) for s in samples)):
            return self(samples)
        images = [s[0] for s in samples]
        if images[0].dtype != torch.uint8 or not stackable(images):
            return self(samples)
        shape = (len(images), *images[0].shape)
        if self._staging is None or self._staging.shape != shape:
            self._staging = torch.empty(shape, dtype=torch.uint8)
        stack_into(self._staging, images)
        # default_collate of tuples: a list, one collated entry per position
        rest = [default_collate(list(column)) for column in list(zip(*samples, strict=True))[1:]]
        return [self.tail.into(self._staging, empty), *rest]


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
    type, dtype, shape and normalisation the user's transform gives, and the same random crop
    windows, flips and later augmentations for the same seed; pixels differ from Pillow's by a
    few grey levels.

    Recognised: the default PIL loader, and a transform (v1 or v2, ``Compose``, a wrapper that
    only calls a ``Compose`` in ``.transforms`` such as torchvision's reference presets, or a
    single transform) that *starts* with ``RandomResizedCrop``, timm's
    ``RandomResizedCropAndInterpolation``, ``Resize``, ``CenterCrop`` and
    ``RandomHorizontalFlip`` (bilinear or bicubic, antialiased) and at most one conversion
    (``ToTensor``, ``PILToTensor``, ``ToImage``; timm's ``MaybeToTensor``,
    ``MaybePILToTensor``, ``ToTensor``, ``ToNumpy``). That prefix runs the fast way; the rest
    (``Normalize``, ``ColorJitter``, RandAugment, ``RandomErasing``, anything) runs as the user's
    own objects on the object the prefix would have given them (a PIL image, or the
    conversion's tensor). When not even the first piece is recognised, one warning names it
    and the dataset is returned unchanged: the data never silently differs. A
    :class:`fastfeed.vision.ImageFolder` is already fast and is returned as is.

    Args:
        dataset: the user's dataset.
        defer_tail (bool): items stop at uint8 CHW; pass :func:`batch_tail` of the result as
            ``FastLoader(..., device="cuda", gpu_transform=...)`` to convert and normalise each
            batch on the copy stream (a quarter of the bytes cross PCIe; identical values).
            Only for a tail of ``ToDtype``, ``ConvertImageDtype``, ``Normalize`` and
            ``ToPureTensor`` after a conversion; otherwise a warning names the piece that must
            run per sample, and items keep the user's output.

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
    per_sample = plan.per_sample_piece()
    if defer_tail and per_sample is not None:
        warnings.warn(f"fastfeed.vision.accelerate: defer_tail=True ignored, {per_sample} runs "
                      "per sample; items keep the transform's output", stacklevel=2)
        defer_tail = False
    return _with_transform(dataset, FusedTransform(dataset.transform,  # type: ignore[attr-defined]
                                                   plan, defer_tail))


def _with_transform(dataset: Dataset, transform: FusedTransform) -> Dataset:
    fast = copy.copy(dataset)
    fast.loader = read_encoded  # type: ignore[attr-defined]
    fast.transform = transform  # type: ignore[attr-defined]
    return fast


def batch_tail(dataset: Dataset) -> Callable[[Any], Any]:
    """The :class:`BatchTail` of a dataset accelerated with ``defer_tail=True``."""
    transform = getattr(dataset, "transform", None)
    if not isinstance(transform, FusedTransform) or not transform.defer_tail:
        raise ValueError("batch_tail needs a dataset from accelerate(..., defer_tail=True)")
    return BatchTail(transform.plan)


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
    return _with_transform(dataset, deferred), BatchTail(transform.plan)
