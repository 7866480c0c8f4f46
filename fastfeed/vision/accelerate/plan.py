"""The plan: a user's pipeline split into the prefix fastfeed runs by window decode and the
tail the user's own objects run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastfeed.vision.accelerate.recognise import (
    BATCHABLE,
    CONVERSIONS,
    GEOMETRY,
    RESIZES,
    TIMM_RRC,
    describe,
    flatten,
    interpolation_mode,
    kind,
)

__all__ = ["Plan", "UnsupportedPipeline", "compile_plan"]


class UnsupportedPipeline(ValueError):
    """The dataset or transform holds something :func:`accelerate` cannot reproduce."""


@dataclass
class Plan:
    """A pipeline split into the prefix fastfeed runs and the tail the user's objects run.

    Attributes:
        geometry: the prefix's ``(kind, object)`` crops, resizes and flips, in order.
        conversion: the prefix's ``(kind, object)`` conversion; ``None`` when the tail gets a
            PIL image.
        tail: the user's objects after the prefix.
    """

    geometry: list[tuple[str, Any]]
    conversion: tuple[str, Any] | None
    tail: list[Any]

    def per_sample_piece(self) -> str | None:
        """What keeps the tail from running on whole batches (named), or ``None``."""
        if self.conversion is None:
            return "a PIL image output"
        if self.conversion[0] == "timm.ToNumpy":
            return "ToNumpy"
        return next((describe(t) for t in self.tail if kind(t) not in BATCHABLE), None)


def _geometry_problem(transform: Any, name: str) -> str | None:
    """Why this geometry piece cannot be folded into the window, or ``None``."""
    if name in ("RandomResizedCrop", "Resize", TIMM_RRC):
        modes = transform.interpolation
        for mode in modes if isinstance(modes, (tuple, list)) else [modes]:
            if interpolation_mode(mode) is None:
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


def compile_plan(transform: Any) -> Plan:
    """Split a transform into the longest prefix fastfeed reproduces and the user's tail.

    Raises:
        UnsupportedPipeline: the prefix is empty (the message names the first piece).
    """
    if transform is None:
        raise UnsupportedPipeline("transform=None (the dataset returns PIL images)")
    pieces = flatten(transform)
    if not pieces:
        raise UnsupportedPipeline("an empty transform")
    geometry: list[tuple[str, Any]] = []
    conversion: tuple[str, Any] | None = None
    prefix = 0
    for piece in pieces:
        name = kind(piece)
        # Geometry after ToNumpy would fail in the stock pipeline too: left to the tail.
        geometry_ok = conversion is None or conversion[0] != "timm.ToNumpy"
        # One resize at most: two resample twice (Resize(32) then Resize(224) is blurred),
        # which one resize from the source window cannot reproduce.
        if name in RESIZES and any(taken in RESIZES for taken, _ in geometry):
            break
        if name in GEOMETRY and geometry_ok and _geometry_problem(piece, name) is None:
            geometry.append((name, piece))
        elif name in CONVERSIONS and conversion is None:
            conversion = (name, piece)
        else:
            break
        prefix += 1
    if not geometry and conversion is None:
        first = pieces[0]
        raise UnsupportedPipeline(_geometry_problem(first, kind(first)) or describe(first))
    return Plan(geometry, conversion, pieces[prefix:])
