"""Collating into a pool slot: one protocol, whatever the ``collate_fn``.

A worker with a slot collates with ``collate_into(samples, empty)``, where ``empty(shape,
dtype)`` returns a tensor in the slot (or an ordinary one when the slot is full). Three kinds
of ``collate_fn`` meet it:

* ``default_collate``: :func:`default_collate_into`, torch's own structure walk with the
  tensor stacking done into ``empty``'s memory, so a batch equals ``default_collate``'s bit
  for bit; only where the stacked tensors live differs. Tensors that cannot take the fast
  path (mixed shapes or dtypes, subclasses, autograd leaves, nested or sparse layouts) go to
  torch's ``collate_tensor_fn``, which raises torch's errors.
* a *slot-aware* collate, an object with a ``collate_into`` method of that signature (the
  collates of the vision and Ultralytics integrations);
* any other callable, which allocates its own memory; the codec copies its tensors into the
  slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from fastfeed._stack import bytes_are_values, gather_addresses, stack_hwc_to_chw, stack_into
from fastfeed._torch_compat import collate_tensor_fn, collate_with, default_collate

__all__ = ["CollateInto", "Empty", "SlotCollate", "as_collate_into", "batch_shape",
           "default_collate_into", "gather_images", "stackable", "torch_empty"]

Empty = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
CollateInto = Callable[[list, Empty], Any]


@runtime_checkable
class SlotCollate(Protocol):
    """A ``collate_fn`` that can allocate its output tensors with ``empty``."""

    def __call__(self, samples: list) -> Any: ...

    def collate_into(self, samples: list, empty: Empty) -> Any: ...


def torch_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Ordinary memory: what a slot-aware collate allocates when called plainly."""
    return torch.empty(shape, dtype=dtype)


def stackable(samples: Sequence[Any]) -> bool:
    """Whether ``samples`` are plain CPU tensors of one shape and dtype (the fast stack)."""
    first = samples[0]
    return all(bytes_are_values(s) and s.dtype == first.dtype and s.shape == first.shape
               for s in samples)


def _stack_into(empty: Empty, samples: Sequence[torch.Tensor], *,
                collate_fn_map: Any = None) -> torch.Tensor:
    addresses = gather_addresses(samples)  # the common case, checked in one pass
    if addresses is None and not stackable(samples):
        return collate_tensor_fn(samples, collate_fn_map=collate_fn_map)
    out = empty((len(samples), *samples[0].shape), samples[0].dtype)
    stack_into(out, samples, addresses=addresses)
    return out


def default_collate_into(samples: list, empty: Empty) -> Any:
    """Collate ``samples`` exactly as ``default_collate`` would, stacking into ``empty``."""
    return collate_with(samples, partial(_stack_into, empty))


def batch_shape(images: Sequence[np.ndarray | torch.Tensor]) -> tuple[int, ...]:
    """The one shape of a batch's images.

    Raises:
        ValueError: the batch is empty, or its images differ in shape.
    """
    if not images:
        raise ValueError("cannot collate an empty batch")
    shapes = {tuple(image.shape) for image in images}
    if len(shapes) != 1:
        raise ValueError(f"fastfeed: the images of one batch differ in shape: {sorted(shapes)}")
    return shapes.pop()


def gather_images(images: Sequence[np.ndarray | torch.Tensor], empty: Empty,
                  reverse_channels: Sequence[bool] | None = None) -> torch.Tensor:
    """Stack a batch's images into one tensor from ``empty``, in one pass.

    uint8 ``H×W×C`` numpy arrays (OpenCV-style, any strides) become ``N×C×H×W``, channels read
    last to first where ``reverse_channels`` says so; tensors are stacked as they are.

    Raises:
        ValueError: the batch is empty, or its images differ in shape.
    """
    shape = batch_shape(images)
    if isinstance(images[0], np.ndarray):
        height, width, channels = shape
        out = empty((len(images), channels, height, width), torch.uint8)
        stack_hwc_to_chw(out, images, reverse_channels)
    else:
        out = empty((len(images), *shape), images[0].dtype)
        stack_into(out, images)  # type: ignore[arg-type]
    return out


def _ignore_empty(collate_fn: Callable[[list], Any], samples: list, empty: Empty) -> Any:
    return collate_fn(samples)


def as_collate_into(collate_fn: Callable[[list], Any]) -> CollateInto:
    """``collate_fn`` as a function of ``(samples, empty)`` (see the module's docstring)."""
    if collate_fn is default_collate:
        return default_collate_into
    if isinstance(collate_fn, SlotCollate):
        return collate_fn.collate_into
    return partial(_ignore_empty, collate_fn)
