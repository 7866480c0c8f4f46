"""``accelerate(dataset, decode_device="cuda")``: the JPEG decode, the crop, the resize, the
flip, the conversion and the normalisation of the user's pipeline, on the GPU.

The workers read each file's bytes and draw its geometry with the user's own transform objects
(:func:`~.geometry.draw_window`: the same draws in the same order as the stock pipeline, so the
same crop windows and flips for the same seed), and hand over an
:class:`~fastfeed.vision.gpu_decode.EncodedCrop`. On the loader's copy stream, in its helper
thread, :class:`~fastfeed.vision.gpu_decode.DecodeCrops` decodes the batch with nvJPEG and
resizes it in about ten kernels per group of similar crops, the conversion and elementwise
tail (``ToTensor``, ``ConvertImageDtype``, ``ToDtype``, ``Normalize``, ``ToPureTensor``)
folded into one per-channel scale and shift fitted to the user's own objects
(:func:`pixel_affine`). A file nvJPEG cannot take, and a ``CenterCrop`` that pads, is made by
its worker the CPU route's way (the same draws) and joins its batch on the GPU; a file nvJPEG
refuses all the same is decoded on the host with its batch, and one nothing decodes raises,
naming it.

FastLoader with a device chooses the route (the :mod:`fastfeed.tail_split` hook); read directly, or
by another loader, the dataset is the CPU route's. The pixels differ from Pillow's (nvJPEG
does no fancy chroma upsampling; the resize is in float): the route is opted into.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from fastfeed.tail_split import BatchTailSplit
from fastfeed.vision.accelerate.fused import EncodedImage, FusedTransform, with_transform
from fastfeed.vision.accelerate.geometry import draw_window, needs_padding
from fastfeed.vision.accelerate.plan import Plan, UnsupportedPipeline
from fastfeed.vision.accelerate.tail_ops import BatchTail
from fastfeed.vision.gpu_decode import (
    DecodeCrops,
    EncodedCrop,
    encoded_collate,
    gpu_decodable,
)
from fastfeed.vision.resample import UINT8, PixelAffine, crop_geometry
from fastfeed.vision.window_decode import image_size

__all__ = ["CropsForGpu", "GpuDecodeTransform", "pixel_affine"]

_NEEDS_CUDA = ("fastfeed.vision.accelerate(..., decode_device='cuda'): the GPU decodes this "
               "dataset's batches; give FastLoader device='cuda' (or accelerate the dataset "
               "without decode_device, to decode on the CPU)")


def pixel_affine(plan: Plan) -> PixelAffine:
    """The conversion and tail of ``plan`` as one map of the resized pixels, ``value *
    scale[c] + offset[c]``, fitted to the user's own objects on the 256 grey levels of each
    channel (and checked on every one of them).

    Raises:
        UnsupportedPipeline: a piece runs per sample, or the tail is not such a map (the
            message says which, or why).
    """
    piece = plan.per_sample_piece()
    if piece is not None:
        raise UnsupportedPipeline(f"{piece} runs per sample")
    levels = torch.arange(256, dtype=torch.uint8).expand(1, 3, 1, 256).contiguous()
    try:
        out = BatchTail(plan)([levels, torch.zeros(1)])[0]
    except Exception as error:  # the user's objects refuse a batch: the CPU route says so
        raise UnsupportedPipeline(f"the tail on a batch ({type(error).__name__}: {error})"
                                  ) from None
    if not isinstance(out, torch.Tensor) or out.shape != levels.shape:
        raise UnsupportedPipeline(f"a tail that gives {type(out).__name__} of another shape")
    if out.dtype == torch.uint8 and torch.equal(out, levels):
        return UINT8
    if not out.dtype.is_floating_point:
        raise UnsupportedPipeline(f"a tail that gives {out.dtype}")
    values = out.double().view(3, 256)
    offset, scale = values[:, 0], (values[:, 255] - values[:, 0]) / 255
    fitted = offset[:, None] + scale[:, None] * torch.arange(256, dtype=torch.float64)
    # within a hundredth of a grey level, and the output dtype's own rounding
    tolerance = (0.01 * scale.abs()
                 + 2 * torch.finfo(out.dtype).eps * values.abs().amax(1))[:, None]
    if bool((scale == 0).any()) or bool(((fitted - values).abs() > tolerance).any()):
        raise UnsupportedPipeline("a tail that is not a scale and a shift of each channel")
    return PixelAffine(out.dtype, tuple(scale.tolist()), tuple(offset.tolist()))


class CropsForGpu:
    """What the workers run for the GPU route: an :class:`EncodedImage` to an
    :class:`EncodedCrop`, its geometry drawn by the user's transform objects; the files nvJPEG
    cannot take, and the crops that pad, made by the CPU route (uint8, with the same draws)."""

    def __init__(self, original: Any, plan: Plan) -> None:
        self.plan = plan
        self.on_cpu = FusedTransform(original, plan, defer_tail=True)

    def __call__(self, encoded: EncodedImage) -> EncodedCrop:
        if not isinstance(encoded, EncodedImage):
            raise TypeError("fastfeed's GPU decode takes what read_encoded returns, got "
                            f"{type(encoded).__name__}: keep the dataset's loader")
        width, height = image_size(encoded.data, encoded.path)
        if not gpu_decodable(encoded.data) or needs_padding(self.plan.geometry, width, height):
            return EncodedCrop.decoded(self.on_cpu(encoded))
        window = draw_window(self.plan.geometry, width, height)
        geometry = crop_geometry((window.x, window.y, window.w, window.h),
                                 (window.width, window.height), window.bounds, window.flipped,
                                 window.mode)
        return EncodedCrop.encoded(encoded.data, geometry, encoded.path)


class GpuDecodeTransform(FusedTransform):
    """The transform of ``accelerate(..., decode_device="cuda")``: called per sample, the CPU
    route's (:class:`FusedTransform`); in FastLoader with a device, its batches are decoded
    and finished on the GPU (:meth:`split_batch_tail`).

    Args:
        original: the user's transform.
        plan: what :func:`~fastfeed.vision.accelerate.accelerate` compiled from it.
        affine: the conversion and tail as :func:`pixel_affine` fitted them.
    """

    def __init__(self, original: Any, plan: Plan, affine: PixelAffine) -> None:
        super().__init__(original, plan)
        self.affine = affine

    def split_batch_tail(self, dataset: Dataset) -> BatchTailSplit:
        """The :mod:`fastfeed.tail_split` hook: ``dataset`` with items that are encoded crops, and
        the GPU stage that finishes their batches; only on a device."""
        crops = with_transform(dataset, CropsForGpu(self.original, self.plan))
        return BatchTailSplit(crops, DecodeCrops(self.affine, needs_cuda=_NEEDS_CUDA),
                              collate=None, tail_into=None, device_collate=encoded_collate,
                              needs_device=_NEEDS_CUDA)
