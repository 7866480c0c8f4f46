"""The tail: the user's own objects after the prefix, per sample or on whole batches.

Some pieces are swapped for a form with the same values that is faster or device-safe
(:func:`tail_ops`). :class:`BatchTail` runs the conversion and an elementwise tail on a whole
batch (on the device, on the copy stream); :class:`TailCollate` runs it in a worker, straight
into the pool slot.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from fastfeed._stack import gather_addresses, gather_through_tables, stack_into
from fastfeed._torch_compat import default_collate
from fastfeed.collate import Empty, stackable, torch_empty
from fastfeed.vision.accelerate.plan import Plan
from fastfeed.vision.accelerate.recognise import TO_FLOAT, TO_UINT8, kind

__all__ = ["BatchTail", "TailCollate", "convert", "run", "tail_ops"]


@functools.cache
def _divisor_255(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """255 as a tensor on the images' device, made once per device (no host-to-device copy
    per batch). CUDA divides by a Python number as a multiply by its reciprocal, which differs
    from the CPU's true division (torchvision's ``ToTensor``) in the last bit of half of the
    values x/255; dividing by a tensor is a true division on every device."""
    return torch.tensor(255, dtype=dtype, device=device)


def convert(images: torch.Tensor, conversion: tuple[str, Any] | None) -> Any:
    """uint8 CHW (or a batch of them) to what the prefix's conversion returns for the
    equivalent PIL image; without a conversion, that PIL image (RGB, as the stock prefix
    gives)."""
    if conversion is None:  # merging the planes is several times faster than making HWC
        return Image.merge("RGB", [Image.fromarray(plane) for plane in images.numpy()])
    name, transform = conversion
    if name in TO_FLOAT:  # torchvision's to_tensor's cast and division (in place: one tensor)
        converted = images.to(dtype=torch.get_default_dtype())
        return converted.div_(_divisor_255(converted.device, converted.dtype))
    if name == "ToImage":
        from torchvision import tv_tensors

        return tv_tensors.Image(images)
    if name == "timm.ToTensor":  # pil_to_tensor, then a cast without scaling
        return images.to(dtype=transform.dtype)
    if name == "timm.ToNumpy":
        return images.numpy()
    return images  # PILToTensor, MaybePILToTensor


def run(transforms: Sequence[Callable[[Any], Any]], image: Any) -> Any:
    for transform in transforms:
        image = transform(image)
    return image


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


def tail_ops(tail: list[Any]) -> list[Callable[[Any], Any]]:
    """The user's tail, with the pieces that have a same-valued faster (or device-safe) form
    swapped for it."""
    ops: list[Callable[[Any], Any]] = []
    for transform in tail:
        name = kind(transform)
        if name == "Normalize":
            ops.append(_Normalize(transform))
        elif name in TO_FLOAT:
            ops.append(_FloatFromPIL(transform))
        elif name == "ConvertImageDtype" and type(transform).__module__.endswith(
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

    def __init__(self, plan: Plan) -> None:
        self.conversion = plan.conversion
        self.ops = tail_ops(plan.tail)
        self._float_start = self._find_float_start()
        self._tables: dict[int, torch.Tensor] = {}  # by channel count (see tables())

    def __call__(self, batch: Any) -> Any:
        images, *rest = batch
        images = run(self.ops, convert(images, self.conversion))
        if isinstance(images, torch.Tensor) and type(images) is not torch.Tensor:
            # default_collate stacks tv_tensors (ToImage's) into a plain tensor
            images = images.as_subclass(torch.Tensor)
        return type(batch)([images, *rest])

    def _find_float_start(self) -> tuple[torch.dtype, list[Callable[[Any], Any]]] | None:
        """``(dtype, the ops after it)`` when the tail starts by dividing the uint8 images by
        255 into floats (``ToTensor``; ``PILToTensor`` then ``ConvertImageDtype``)."""
        if self.conversion is not None and self.conversion[0] in TO_FLOAT:
            return torch.get_default_dtype(), self.ops
        if (self.conversion is not None and self.conversion[0] in TO_UINT8 and self.ops
                and isinstance(self.ops[0], _ToFloat) and self.ops[0].dtype.is_floating_point):
            return self.ops[0].dtype, self.ops[1:]
        return None

    @property
    def converts_to_float(self) -> bool:
        """Whether :meth:`into` can run: the tail starts with a uint8 to float division."""
        return self._float_start is not None

    def into(self, images: torch.Tensor, empty: Empty) -> Any:
        """The tail of the uint8 ``images``, computed in memory from ``empty`` (a pool slot's
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


    def tables(self, channels: int) -> torch.Tensor | None:
        """The tail's value for every byte in each of ``channels`` channels (float32,
        ``channels×256``), where it is that elementwise: a conversion to float32, then
        ``Normalize`` or nothing; else None. Computed by :meth:`into` itself, on an image that
        holds every byte value in every channel, so that a lookup gives its values bit for bit."""
        if self._float_start is None:
            return None
        dtype, ops = self._float_start
        if dtype != torch.float32 or not all(isinstance(op, _Normalize) for op in ops):
            return None
        if channels not in self._tables:
            every_byte = torch.arange(256, dtype=torch.uint8).repeat(channels, 1)
            self._tables[channels] = self.into(every_byte.view(1, channels, 16, 16),
                                               torch_empty).reshape(channels, 256).contiguous()
        return self._tables[channels]

    def finish_into(self, batch: Any, empty: Empty) -> Any:
        """:meth:`__call__` on ``batch`` (``default_collate``'s, uint8 images first), its
        float images computed by :meth:`into` in memory from ``empty``: how the main process
        finishes a batch from Ray workers as it lands it in a pool slot. Anything else takes
        :meth:`__call__`."""
        images, *rest = batch
        if not (self.converts_to_float and type(images) is torch.Tensor
                and images.dtype == torch.uint8):
            return self(batch)
        return type(batch)([self.into(images, empty), *rest])


class TailCollate:
    """``default_collate``, then a :class:`BatchTail`: how :class:`~fastfeed.FastLoader`
    collates an accelerated dataset whose tail runs on whole batches.

    The items stop at uint8 (a quarter of the bytes of float32). In a worker,
    :meth:`collate_into` stacks them once into a private buffer, then computes the float batch
    straight into the pool slot: the per-sample pipeline would allocate, fault in and write a
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

    def collate_into(self, samples: list, empty: Empty) -> Any:
        """Collate ``samples`` (``(uint8 image, target, ...)`` tuples) with the float images
        allocated by ``empty``; anything else takes :meth:`__call__`."""
        first = samples[0] if samples else None
        if not (self.tail.converts_to_float and isinstance(first, tuple)
                and all(type(s) is tuple and len(s) == len(first) for s in samples)):
            return self(samples)
        images = [s[0] for s in samples]
        if images[0].dtype != torch.uint8:
            return self(samples)
        # The common cases, each checked in one pass: images as a resize writes them (H×W×C
        # memory), or contiguous.
        channels_last = True
        addresses = gather_addresses(images, channels_last=True)
        if addresses is None:
            channels_last, addresses = False, gather_addresses(images)
        if addresses is None and not stackable(images):
            return self(samples)
        # default_collate of tuples: a list, one collated entry per position
        rest = [default_collate(list(column)) for column in list(zip(*samples, strict=True))[1:]]
        return [self._float_images(images, addresses, channels_last, empty), *rest]

    def _float_images(self, images: list[torch.Tensor], addresses: list[int] | None,
                      channels_last: bool, empty: Empty) -> torch.Tensor:
        """The tail of the uint8 ``images`` (at ``addresses``, where the gather may read them;
        ``channels_last``: in H×W×C memory), into memory from ``empty``: looked up in its
        tables as the images are gathered, in one pass, where it is a per-channel table; else
        computed from a staging batch of the uint8 images."""
        tables = None
        if addresses is not None and images[0].dim() == 3:
            tables = self.tail.tables(images[0].shape[0])
        if addresses is not None and tables is not None:
            out = empty((len(images), *images[0].shape), tables.dtype)
            gather_through_tables(out, addresses, tables, channels_last)
            return out
        shape = (len(images), *images[0].shape)
        if self._staging is None or self._staging.shape != shape:
            self._staging = torch.empty(shape, dtype=torch.uint8)
        stack_into(self._staging, images, addresses=None if channels_last else addresses)
        return self.tail.into(self._staging, empty)
