"""Ultralytics' per-pixel training augmentation on the device, its random draws on the CPU.

After the mosaic, Ultralytics' training pipeline spends most of a sample's time on three pixel
operations: the random perspective warp, the HSV jitter and the flips. Here, inside each worker,
those three record what they would do instead of doing it: ``RandomPerspective`` its matrix,
``RandomHSV`` its lookup table, each ``RandomFlip`` whether it mirrors, and ``Format`` whether it
reverses the channels. Every random number is drawn by Ultralytics' own
code, in its order, so labels and boxes are exactly the stock ones. The sample carries the
part of the unwarped canvas that the warp reads (about 40 % of a mosaic canvas, on average)
and those parameters; :class:`CanvasCollate` packs the parts into the pool slot, and
:class:`PixelOps`, FastLoader's ``gpu_transform``, applies the parameters to the whole batch on
the device (:mod:`fastfeed.ultralytics.pixel_ops`), so that the trainer receives the ``img`` it
would have received, already on the GPU.

Only pipelines whose pixel work after the warp is exactly HSV, flips and ``Format`` qualify
(Ultralytics' defaults: no mixup, cutmix, copy-paste after the warp, perspective or
Albumentations); :func:`unsupported_reason` names what stops any other.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastfeed.device import pinned_source
from fastfeed.ultralytics.format import draws_reverse
from fastfeed.ultralytics.hsv import draw_lut
from fastfeed.ultralytics.pixel_ops import hsv_lookup, source_region, warp_regions
from fastfeed.ultralytics.slot_collate import Empty, SlotCollate, flatten
from fastfeed.ultralytics.warp import BORDER

__all__ = [
    "CanvasCollate", "PixelOps", "defer_pixel_ops", "opencv_hsv_truncates", "unsupported_reason",
]

# Per sample: the 2×3 matrix, then flags: apply HSV, reverse the channels, mirror left-right,
# mirror upside down (the columns after the matrix).
PARAMS_KEY = "fastfeed_pixel_params"
HSV_FLAG, REVERSE_FLAG, FLIP_LR_FLAG, FLIP_UD_FLAG = 6, 7, 8, 9
PARAM_COLUMNS = 10
_FLAG_COLUMNS = (HSV_FLAG, REVERSE_FLAG, FLIP_LR_FLAG, FLIP_UD_FLAG)
LUT_KEY = "fastfeed_hsv_lut"
# Per sample: its part of the canvas (height, width, left, top); per batch, each row led by
# the index of the part's first pixel in the packed pixels (see pixel_ops.warp_regions).
REGION_KEY = "fastfeed_canvas_region"
# The output (width, height): plain Python, so that reading it never waits for the device.
SIZE_KEY = "fastfeed_output_size"


def unsupported_reason(dataset: Any) -> str | None:
    """Why ``dataset``'s pixel work cannot move to the device, or ``None`` if it can."""
    from ultralytics.data import augment as A

    if not getattr(dataset, "augment", False):
        return "the dataset does not augment (validation)"
    if getattr(dataset, "channels", 3) != 3:
        return "the images are not 3-channel"
    transforms = list(flatten(getattr(dataset, "transforms", None)))
    warps = [i for i, t in enumerate(transforms) if isinstance(t, A.RandomPerspective)]
    if len(warps) != 1:
        return "the pipeline has no single RandomPerspective"
    if transforms[warps[0]].perspective:
        return "perspective > 0 (a projective warp)"
    if not transforms or type(transforms[-1]) is not A.Format:
        return "the pipeline does not end with Ultralytics' Format"
    for t in transforms[warps[0] + 1 : -1]:
        if isinstance(t, (A.RandomHSV, A.RandomFlip)):
            continue
        if isinstance(t, A.BaseMixTransform) and not isinstance(t, A.Mosaic) and t.p == 0:
            continue  # MixUp, CutMix or CopyPaste that never fires
        if isinstance(t, A.Albumentations) and t.transform is None:
            continue
        return f"{type(t).__name__} changes pixels after the warp"
    return None


def opencv_hsv_truncates() -> bool:
    """Whether this OpenCV truncates (OpenCV 5) or rounds (OpenCV 4) in HSV→BGR on uint8."""
    import cv2  # Ultralytics' dependency, imported only where it is used

    probe = np.full((1, 64, 3), (85, 54, 202), np.uint8)  # blue is 194.87 before rounding
    return int(cv2.cvtColor(probe, cv2.COLOR_HSV2BGR)[0, 0, 0]) == 194


class _Recorder:
    """Replaces the pixel work of one dataset's transforms with records, in one process."""

    def __init__(self, dataset: Any) -> None:
        from ultralytics.data import augment as A

        self.reset()
        for t in flatten(dataset.transforms):
            if isinstance(t, A.RandomPerspective):
                t.apply_image = self._warp
            elif isinstance(t, A.RandomHSV):
                t.apply_image = self._hsv_of(t)
            elif isinstance(t, A.RandomFlip):
                t.apply_image = self._flip
            elif type(t) is A.Format:
                t._format_img = self._channel_order_of(t._format_img)
        compose = dataset.transforms
        dataset.transforms = lambda labels: self._finish(compose(labels))

    def reset(self) -> None:
        self.canvas: np.ndarray | None = None
        self.matrix = np.eye(3)
        self.size = (0, 0)
        self.lut = np.zeros((3, 256), np.uint8)
        self.apply_hsv = False
        self.reverse = False
        self.mirrors = {"horizontal": False, "vertical": False}

    def _warp(self, labels: dict, params: dict) -> dict:
        self.canvas = labels["img"]
        self.matrix = np.asarray(params["M"], dtype=np.float64)
        self.size = params["size"]
        width, height = self.size
        # Later transforms read only the shape; a zero-stride view costs nothing.
        labels["img"] = np.broadcast_to(np.uint8(BORDER), (height, width, 3))
        labels["resized_shape"] = (height, width)
        return labels

    def _hsv_of(self, hsv: Any) -> Callable[..., dict]:
        def record(labels: dict, params: dict | None = None) -> dict:
            if hsv.hgain or hsv.sgain or hsv.vgain:
                self.lut, self.apply_hsv = draw_lut(hsv), True
            return labels

        return record

    def _flip(self, labels: dict, params: dict) -> dict:
        if params["flip"]:
            self.mirrors[params["direction"]] ^= True
        return labels

    def _channel_order_of(self, format_img: Callable[[np.ndarray], torch.Tensor]
                          ) -> Callable[[np.ndarray], torch.Tensor]:
        def record(img: np.ndarray) -> torch.Tensor:
            self.reverse = draws_reverse(format_img, 3)
            return torch.empty(0, dtype=torch.uint8)

        return record

    def _finish(self, labels: dict) -> dict:
        canvas = self.canvas
        if canvas is None:
            raise RuntimeError("fastfeed: RandomPerspective did not run for this sample")
        height, width = canvas.shape[:2]
        left, top, right, bottom = source_region(self.matrix, self.size, height, width)
        labels["img"] = torch.from_numpy(canvas[top:bottom, left:right])  # a view: no copy
        flags = [self.apply_hsv, self.reverse, self.mirrors["horizontal"], self.mirrors["vertical"]]
        params = np.concatenate([self.matrix[:2].ravel(), flags])
        labels[PARAMS_KEY] = torch.from_numpy(params)
        labels[LUT_KEY] = torch.from_numpy(self.lut)
        labels[REGION_KEY] = torch.tensor([bottom - top, right - left, left, top])
        labels[SIZE_KEY] = tuple(int(v) for v in self.size)
        self.reset()
        return labels


def defer_pixel_ops(dataset: Any) -> None:
    """Make ``dataset`` (in this process) record its pixel work instead of doing it.

    Raises:
        ValueError: the pipeline does not qualify (see :func:`unsupported_reason`).
    """
    reason = unsupported_reason(dataset)
    if reason is not None:
        raise ValueError(f"fastfeed: this pipeline's pixel work cannot move to a device: {reason}")
    _Recorder(dataset)


class CanvasCollate(SlotCollate):
    """:class:`SlotCollate` for recorded samples: each sample's part of its canvas is packed
    into the slot, one after another (``N×3``), and the per-sample parameters are stacked into
    small tensors and one output size."""

    def collate_into(self, samples: list[dict], empty: Empty) -> dict:
        batch = super().collate_into(samples, empty)
        for key in (PARAMS_KEY, LUT_KEY, REGION_KEY):
            batch[key] = torch.stack(list(batch[key]))
        areas = batch[REGION_KEY][:, 0] * batch[REGION_KEY][:, 1]
        firsts = torch.cumsum(areas, 0) - areas
        batch[REGION_KEY] = torch.cat([firsts.view(-1, 1), batch[REGION_KEY]], 1)
        sizes = set(batch[SIZE_KEY])
        if len(sizes) != 1:
            raise ValueError(f"fastfeed: one batch asks for several output sizes: {sorted(sizes)}")
        batch[SIZE_KEY] = sizes.pop()
        return batch

    def gather(self, images: list, empty: Empty) -> torch.Tensor:
        """The parts, ``H×W×3`` each, packed row by row into one ``N×3`` tensor."""
        packed = empty((sum(len(i) * i.shape[1] for i in images), 3), torch.uint8)
        first = 0
        for image in images:
            area = len(image) * image.shape[1]
            packed[first:first + area].view(image.shape).copy_(image)
            first += area
        return packed


class PixelOps:
    """FastLoader's ``gpu_transform``: apply the recorded warp, HSV, flips and channel order.

    Turns ``batch["img"]``, the packed parts of the canvases, into the ``B×3×H×W`` uint8
    images Ultralytics' ``Format`` would have produced, on the batch's device. A batch without
    recorded parameters passes through.

    On a CUDA device the whole batch is one Triton kernel launch
    (:mod:`fastfeed.ultralytics.pixel_kernel`); elsewhere, or without Triton, the torch ops of
    :mod:`fastfeed.ultralytics.pixel_ops` (some 470 launches a batch on a GPU), which are also
    the reference the kernel is tested against. Both compute OpenCV's arithmetic step for
    step. Neither reads a device value back: the host only queues work on the loader's copy
    stream.

    Args:
        truncate_hsv (bool): HSV→BGR truncates as OpenCV 5 does (else rounds, as OpenCV 4).
            Default: this process's OpenCV (:func:`opencv_hsv_truncates`).
        fused (bool, optional): ``None`` (default): the kernel on CUDA devices where Triton
            imports and builds it, else the torch ops (with a warning where the kernel failed
            to build); decided when FastLoader prepares it (:meth:`prepare`) or at the first
            batch, and kept. ``True``: the kernel, on any
            device (on the CPU under ``TRITON_INTERPRET=1``: tests), or an error. ``False``:
            the torch ops.
    """

    # Queueing the work costs host time (one Triton launch, or the torch ops' hundreds), so
    # FastLoader runs this transform, with the batch's copy, on its helper thread, as it runs
    # the nvjpeg decode: the training thread only picks up batches already queued.
    blocks_host = True

    def __init__(self, truncate_hsv: bool | None = None, fused: bool | None = None) -> None:
        self.truncate_hsv = opencv_hsv_truncates() if truncate_hsv is None else truncate_hsv
        self.fused = fused

    def __call__(self, batch: dict) -> dict:
        if PARAMS_KEY not in batch:
            return batch
        params, luts = batch.pop(PARAMS_KEY), batch.pop(LUT_KEY)
        regions, size = batch.pop(REGION_KEY), batch.pop(SIZE_KEY)
        pixels = batch["img"]
        kernel = self._kernel(pixels.device)
        if kernel is not None:
            try:
                batch["img"] = kernel(pixels, regions, params, luts, size, BORDER,
                                      self.truncate_hsv, _FLAG_COLUMNS)
                self.fused = True  # it builds here: from now on, any error is one
                return batch
            except (ValueError, torch.cuda.OutOfMemoryError):
                raise  # a bad batch, or no memory: not the kernel's build
            except Exception as error:  # Triton's compiler and launcher raise many kinds
                if self.fused:
                    raise
                warnings.warn(f"fastfeed: augment_device's Triton kernel failed to build "
                              f"({type(error).__name__}: {error}); using torch ops, some 470 "
                              "launches a batch", RuntimeWarning, stacklevel=2)
                self.fused = False
        images = warp_regions(pixels, regions, params[:, :6].view(-1, 2, 3), size, BORDER)
        images = hsv_lookup(images, luts, params[:, HSV_FLAG] > 0, self.truncate_hsv)
        images = _flipped_where(images, params[:, FLIP_LR_FLAG], 2)  # np.fliplr of H×W×C
        images = _flipped_where(images, params[:, FLIP_UD_FLAG], 1)
        chw = images.permute(0, 3, 1, 2)
        batch["img"] = _flipped_where(chw, params[:, REVERSE_FLAG], 1).contiguous()
        return batch

    def prepare(self, device: torch.device) -> None:
        """Build the fused kernel for ``device`` now, where it will be used. FastLoader runs
        this on its helper thread as the iterator is made, while the workers make the first
        batches: Triton's first compile (seconds with a cold cache, on every rank) is then not
        in the training thread's first wait. One batch of one 32×32 image: the argument types
        and the specialisation of Ultralytics' batches (sizes multiples of 32)."""
        if device.type != "cuda" or self._kernel(device) is None:
            return  # no compile to move: the torch ops, or Triton's interpreter (tests)
        side = 32
        params = torch.zeros((1, PARAM_COLUMNS), dtype=torch.float64)
        params[0, 0] = params[0, 4] = 1.0  # the identity warp
        host = {"img": torch.zeros((side * side, 3), dtype=torch.uint8), PARAMS_KEY: params,
                LUT_KEY: torch.zeros((1, 3, 256), dtype=torch.uint8),
                REGION_KEY: torch.tensor([[0, side, side, 0, 0]])}
        batch: dict = {key: pinned_source(value).to(device, non_blocking=True)
                       for key, value in host.items()}
        self({**batch, SIZE_KEY: (side, side)})

    def _kernel(self, device: torch.device) -> Callable[..., torch.Tensor] | None:
        """The fused kernel's launcher where this call should use it, else ``None``."""
        if self.fused is False or (self.fused is None and device.type != "cuda"):
            return None
        try:
            from fastfeed.ultralytics.pixel_kernel import apply_pixel_ops
        except ImportError:
            if self.fused:
                raise
            self.fused = False  # no Triton here (a CPU-only or Windows build of torch)
            return None
        return apply_pixel_ops


def _flipped_where(images: torch.Tensor, flags: torch.Tensor, dim: int) -> torch.Tensor:
    """Each image of the batch flipped along ``dim`` where its flag is set; selected on the
    device, so that the host never waits for it."""
    flagged = (flags > 0).to(images.device).view(-1, *([1] * (images.dim() - 1)))
    return torch.where(flagged, images.flip(dim), images)

