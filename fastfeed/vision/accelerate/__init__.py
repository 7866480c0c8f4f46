"""``accelerate``: speed up a user's own torchvision ``ImageFolder`` without changing it.

A classic torchvision pipeline decodes the whole JPEG with Pillow, then crops and resizes it.
:func:`accelerate` recognises the pipeline's leading crop and resize and runs that *prefix* the
fast way: the crop windows and flips come from the *user's transform objects* with their own
random draws (torchvision's from torch's generator, timm's from Python's ``random``), in the
same order, so labels, order and augmentation parameters equal the stock pipeline's for the
same seed. Only the pixels are made differently: just the window of the JPEG is decoded, at a
reduced DCT scale, then resized with torch's antialiased uint8 kernel
(:mod:`fastfeed.vision.window_decode`), a few grey levels from Pillow's result.

The package, one job a module:

- :mod:`~.recognise`: which transforms are reproduced, by library and name;
- :mod:`~.plan`: the pipeline split into the prefix (its geometry, folded into one source
  window, and at most one conversion) and the *tail*, everything after it (``Normalize``,
  ``ColorJitter``, RandAugment, ``RandomErasing``, anything), which the user's own objects run
  in order, making the same random draws as in the stock pipeline;
- :mod:`~.geometry`: the window, drawn by the transforms' own code;
- :mod:`~.torch_draws`: in a worker process, the numbers torchvision's own crop and flips
  would draw, made from a copy of torch's generator state without a torch op per number;
- :mod:`~.tail_ops`: the tail per sample, or on whole batches (in the pool slot, or on the device);
- :mod:`~.fused`: the accelerated dataset's loader and transform;
- :mod:`~.on_gpu`: ``decode_device="cuda"``, the decode and all of the prefix and tail on the
  GPU (the crop windows and flips still drawn by the workers, with the user's objects).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

from fastfeed.vision.accelerate.fused import (
    EncodedImage,
    FusedTransform,
    deferred_for_device,
    read_encoded,
    with_transform,
)
from fastfeed.vision.accelerate.on_gpu import GpuDecodeTransform, pixel_affine
from fastfeed.vision.accelerate.plan import UnsupportedPipeline, compile_plan
from fastfeed.vision.accelerate.tail_ops import BatchTail, TailCollate
from fastfeed.vision.folder import ImageFolder

__all__ = [
    "BatchTail", "EncodedImage", "FusedTransform", "GpuDecodeTransform", "TailCollate",
    "UnsupportedPipeline", "accelerate", "batch_tail", "deferred_for_device", "read_encoded",
]


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


def _warn(message: str) -> None:
    warnings.warn(f"fastfeed.vision.accelerate: {message}", stacklevel=3)


def _check_decode_device(decode_device: Any, defer_tail: bool) -> None:
    if decode_device is None:
        return
    try:
        kind = torch.device(decode_device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind != "cuda":
        raise ValueError(f"decode_device should be 'cuda' (or None), got {decode_device!r}")
    if defer_tail:
        raise ValueError("decode_device='cuda' finishes the batches on the GPU itself: "
                         "leave defer_tail=False")


def accelerate(dataset: Dataset, *, defer_tail: bool = False,
               decode_device: str | torch.device | None = None) -> Dataset:
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
        defer_tail (bool): items stop at uint8 CHW (views of ``H×W×C`` memory, as the
            resize writes them: ``.contiguous()`` where a plain layout is needed); pass
            :func:`batch_tail` of the result as
            ``FastLoader(..., device="cuda", gpu_transform=...)`` to convert and normalise each
            batch on the copy stream (a quarter of the bytes cross PCIe; identical values).
            Only for a tail of ``ToDtype``, ``ConvertImageDtype``, ``Normalize`` and
            ``ToPureTensor`` after a conversion; otherwise a warning names the piece that must
            run per sample, and items keep the user's output.
        decode_device: ``"cuda"``: in a ``FastLoader(..., device="cuda")``, the workers only
            read the files and draw the crop windows and flips (with the user's objects, as
            stock draws them); the loader's GPU decodes each batch (nvJPEG, through
            torchvision), crops, resizes, flips, converts and normalises it, off the training
            thread (:mod:`~.on_gpu`). Pixels differ from Pillow's a little more than the CPU
            route's (see docs/torchvision.md). For the classic pipeline and torchvision's
            reference presets: a conversion, then elementwise ops only; otherwise one warning
            names what runs per sample and the images are decoded on the CPU. A FastLoader
            without ``device`` refuses the dataset (``ValueError``); read directly, or by
            another loader, it is the CPU route's.

    Example:
        >>> train = torchvision.datasets.ImageFolder("imagenet/train", transform=classic)
        >>> train = fastfeed.vision.accelerate(train)
        >>> loader = FastLoader(train, batch_size=256, shuffle=True, num_workers=8)
        >>> # or decode on the GPU, off the training thread:
        >>> train = fastfeed.vision.accelerate(train, decode_device="cuda")
        >>> loader = FastLoader(train, batch_size=256, shuffle=True, num_workers=8,
        ...                     device="cuda")
    """
    _check_decode_device(decode_device, defer_tail)
    if isinstance(dataset, ImageFolder):
        if decode_device is not None:
            _warn("decode_device ignored for fastfeed.vision.ImageFolder: use "
                  "image_loader(..., backend='nvjpeg') to decode it on the GPU")
        return dataset
    try:
        _check_dataset(dataset)
        plan = compile_plan(dataset.transform)  # type: ignore[attr-defined]
    except UnsupportedPipeline as unsupported:
        _warn(f"{unsupported} is not supported; the dataset runs unchanged")
        return dataset
    transform = dataset.transform  # type: ignore[attr-defined]
    if decode_device is not None:
        try:
            return with_transform(dataset, GpuDecodeTransform(transform, plan,
                                                              pixel_affine(plan)))
        except UnsupportedPipeline as why:
            _warn(f"decode_device={decode_device!r} ignored, {why}; the images are decoded "
                  "on the CPU")
    per_sample = plan.per_sample_piece()
    if defer_tail and per_sample is not None:
        _warn(f"defer_tail=True ignored, {per_sample} runs per sample; items keep the "
              "transform's output")
        defer_tail = False
    return with_transform(dataset, FusedTransform(transform, plan, defer_tail))


def batch_tail(dataset: Dataset) -> Callable[[Any], Any]:
    """The :class:`BatchTail` of a dataset accelerated with ``defer_tail=True``."""
    transform = getattr(dataset, "transform", None)
    if not isinstance(transform, FusedTransform) or not transform.defer_tail:
        raise ValueError("batch_tail needs a dataset from accelerate(..., defer_tail=True)")
    return BatchTail(transform.plan)
