"""Which transforms :func:`~fastfeed.vision.accelerate` reproduces: names by library, the
interpolation modes it resizes with, and the wrappers it looks through."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Sequence
from typing import Any

from PIL import Image

__all__ = ["BATCHABLE", "CONVERSIONS", "CROPS", "GEOMETRY", "RESIZES", "TIMM_RRC", "TO_FLOAT",
           "TO_UINT8", "describe", "flatten", "interpolation_mode", "kind"]

TIMM_RRC = "timm.RandomResizedCropAndInterpolation"
CROPS = ("RandomResizedCrop", TIMM_RRC)
GEOMETRY = (*CROPS, "Resize", "CenterCrop", "RandomHorizontalFlip")
RESIZES = (*CROPS, "Resize")
# Conversions from a PIL image, and what each gives for the equivalent uint8 CHW tensor.
TO_FLOAT = ("ToTensor", "timm.MaybeToTensor")  # float in [0, 1]
TO_UINT8 = ("PILToTensor", "timm.MaybePILToTensor")
CONVERSIONS = (*TO_FLOAT, *TO_UINT8, "ToImage", "timm.ToTensor", "timm.ToNumpy")
# Tail pieces that are elementwise on a tensor: they can run on a whole batch, on the device.
BATCHABLE = ("ToDtype", "ConvertImageDtype", "Normalize", "ToPureTensor")
_RESAMPLING = {Image.Resampling.BILINEAR: "bilinear", Image.Resampling.BICUBIC: "bicubic"}


def kind(transform: Any) -> str:
    """The class name for torchvision's own classes (v1 or v2), ``timm.``-prefixed for timm's
    (timm's ``ToTensor`` does not scale); ``""`` for anything else."""
    cls = type(transform)
    if cls.__module__.startswith("torchvision.transforms"):
        return cls.__name__
    if cls.__module__.startswith("timm.data"):
        return f"timm.{cls.__name__}"
    return ""


def interpolation_mode(interpolation: Any) -> str | None:
    """``"bilinear"``/``"bicubic"`` for an ``InterpolationMode``, its string value or a Pillow
    constant (torchvision keeps any of them); ``None`` for modes fastfeed does not resize with."""
    if isinstance(interpolation, int):
        return _RESAMPLING.get(interpolation)  # type: ignore[call-overload]
    value = str(getattr(interpolation, "value", interpolation))
    return value if value in ("bilinear", "bicubic") else None


def describe(piece: Any) -> str:
    """A transform's repr on one line, for messages."""
    return repr(piece).replace("\n", " ")


def flatten(transform: Any) -> list[Any]:
    """The pieces of a transform in the order they run: nested ``Compose`` s and wrappers
    that only call their ``.transforms`` are opened."""
    inner = getattr(transform, "transforms", None)
    if type(transform).__name__ == "Compose" and isinstance(inner, Sequence):
        return [t for child in inner for t in flatten(child)]
    if _delegates_to_transforms(transform):
        return flatten(inner)
    return [transform]


def _delegates_to_transforms(transform: Any) -> bool:
    """Whether calling ``transform`` only calls its ``.transforms``: torchvision's reference
    presets (``ClassificationPresetTrain``/``Eval``) and wrappers like them.

    Such a wrapper has no marker but its code, so the source of ``__call__`` is read: a
    wrapper that does anything more than ``return self.transforms(image)`` is not taken apart.
    """
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
