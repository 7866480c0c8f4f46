"""Batch transforms for the device: run on whole batches, on the GPU's copy stream.

Each transform takes the batch and returns a new one. ``key`` picks the leaf it works on: a
dict key (``"img"``), a position (``0`` for ``(images, targets)``) or ``None`` for a batch that
is itself a tensor. Random transforms draw from their own generator on the batch's device;
FastLoader seeds it from the iterator's base seed, so a seeded loader gives the same
augmentations every run without consuming extra draws from its ``generator``.

Example:
    >>> from fastfeed import transforms as T
    >>> gpu_transform = T.Compose([
    ...     T.RandomHorizontalFlip(key="img", boxes_key="bboxes", batch_idx_key="batch_idx"),
    ...     T.Normalize(IMAGENET_MEAN, IMAGENET_STD, key="img", dtype=torch.float16),
    ...     T.ChannelsLast(key="img"),
    ... ])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from fastfeed.tree import update_at

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "BatchTransform",
    "ChannelsLast",
    "Compose",
    "Normalize",
    "RandomErasing",
    "RandomHorizontalFlip",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class BatchTransform:
    """Base class: applies :meth:`forward` to the leaf chosen by ``key``."""

    def __init__(self, key: Hashable | None = None) -> None:
        self.key = key
        self._seed: int | None = None
        self._generators: dict[torch.device, torch.Generator] = {}

    def seed(self, seed: int) -> None:
        """Reset the random stream of this transform (called by FastLoader per epoch)."""
        self._seed = seed
        self._generators.clear()

    def generator(self, device: torch.device) -> torch.Generator:
        """This transform's generator on ``device``, seeded from :meth:`seed` (or randomly)."""
        if device not in self._generators:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._generators[device] = generator
        return self._generators[device]

    def forward(self, value: Any) -> Any:
        raise NotImplementedError

    def __call__(self, batch: Any) -> Any:
        return update_at(batch, self.key, self.forward)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key={self.key!r})"


def _images(value: Any, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 4:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name} expects an N×C×H×W tensor, got {shape}")
    return value


class Compose(BatchTransform):
    """Apply ``transforms`` in order; seeding one seeds all, each with its own stream."""

    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        super().__init__()
        self.transforms = list(transforms)

    def seed(self, seed: int) -> None:
        for offset, transform in enumerate(self.transforms):
            if hasattr(transform, "seed"):
                transform.seed(seed + offset)

    def __call__(self, batch: Any) -> Any:
        for transform in self.transforms:
            batch = transform(batch)
        return batch

    def __repr__(self) -> str:
        return f"Compose({self.transforms!r})"


class Normalize(BatchTransform):
    """``(x / max_value - mean) / std`` in ``dtype``, from uint8 (or any) images.

    The scaling and normalisation are folded into one multiply-add (``x * a + b`` with
    per-channel ``a = 1 / (max_value * std)``, ``b = -mean / std``), computed in float32 in a
    single ``addcmul`` kernel, then cast to ``dtype`` (float16/bfloat16) if needed.

    Args:
        mean, std: per-channel statistics on the ``[0, 1]`` scale.
        key: which leaf of the batch holds the N×C×H×W images.
        dtype: output dtype: float32, float16 or bfloat16.
        max_value: the value that maps to 1.0 (255 for uint8 images).
    """

    def __init__(
        self,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        key: Hashable | None = None,
        dtype: torch.dtype = torch.float32,
        max_value: float = 255.0,
    ) -> None:
        super().__init__(key)
        if len(mean) != len(std):
            raise ValueError(f"mean has {len(mean)} channels but std has {len(std)}")
        if any(s <= 0 for s in std):
            raise ValueError(f"std must be positive, got {tuple(std)}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        mean_t = torch.tensor(mean, dtype=torch.float64)
        std_t = torch.tensor(std, dtype=torch.float64)
        self._scale = (1.0 / (max_value * std_t)).float().view(-1, 1, 1)
        self._bias = (-mean_t / std_t).float().view(-1, 1, 1)
        self.dtype = dtype
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        images = _images(images, "Normalize")
        if images.shape[1] != self._scale.shape[0]:
            raise ValueError(
                f"Normalize has {self._scale.shape[0]} channels but images have {images.shape[1]}"
            )
        if images.device not in self._on_device:
            self._on_device[images.device] = (
                self._scale.to(images.device), self._bias.to(images.device))
        scale, bias = self._on_device[images.device]
        out = torch.addcmul(bias, images, scale)
        return out if self.dtype == torch.float32 else out.to(self.dtype)


class ChannelsLast(BatchTransform):
    """Convert N×C×H×W images to ``torch.channels_last`` memory format."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return _images(images, "ChannelsLast").contiguous(memory_format=torch.channels_last)


class RandomHorizontalFlip(BatchTransform):
    """Flip each image left-right with probability ``p``; flip its boxes too.

    Args:
        p: probability per sample.
        key: the images (N×C×H×W) in the batch; with ``boxes_key`` the batch must be a mapping.
        boxes_key: optional key of the boxes (M×4) of all samples, as Ultralytics collates them.
        batch_idx_key: key of the (M,) sample index of each box (required with ``boxes_key``).
        box_format: ``"xywhn"`` (normalised centre x, y, w, h: Ultralytics) or ``"xyxy"``
            (pixel corners).
    """

    def __init__(
        self,
        p: float = 0.5,
        key: Hashable | None = None,
        boxes_key: Hashable | None = None,
        batch_idx_key: Hashable | None = None,
        box_format: str = "xywhn",
    ) -> None:
        super().__init__(key)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        if box_format not in ("xywhn", "xyxy"):
            raise ValueError(f"box_format must be 'xywhn' or 'xyxy', got {box_format!r}")
        if (boxes_key is None) != (batch_idx_key is None):
            raise ValueError("boxes_key and batch_idx_key go together")
        self.p, self.boxes_key, self.batch_idx_key, self.box_format = (
            p, boxes_key, batch_idx_key, box_format)

    def sample(self, n: int, device: torch.device) -> torch.Tensor:
        """The per-sample flip decisions for a batch of ``n`` (bool, shape (n,))."""
        return torch.rand(n, device=device, generator=self.generator(device)) < self.p

    def __call__(self, batch: Any) -> Any:
        images = _images(batch if self.key is None else batch[self.key], "RandomHorizontalFlip")
        flip = self.sample(images.shape[0], images.device)
        flipped = torch.where(flip.view(-1, 1, 1, 1), images.flip(-1), images)
        batch = update_at(batch, self.key, lambda _: flipped)
        if self.boxes_key is None:
            return batch
        boxes, batch_idx = batch[self.boxes_key], batch[self.batch_idx_key]
        per_box = flip[batch_idx.long()].unsqueeze(-1)
        if self.box_format == "xywhn":
            mirrored = torch.cat([1 - boxes[:, :1], boxes[:, 1:]], dim=1)
        else:
            width = images.shape[-1]
            mirrored = torch.stack(
                [width - boxes[:, 2], boxes[:, 1], width - boxes[:, 0], boxes[:, 3]], dim=1)
        return update_at(batch, self.boxes_key, lambda _: torch.where(per_box, mirrored, boxes))


class RandomErasing(BatchTransform):
    """Erase one random rectangle per image with probability ``p`` (as torchvision's, per sample).

    Rectangles cover ``scale`` of the image area with aspect ratio in ``ratio`` (log-uniform),
    clipped to the image. All samples are processed in one vectorised pass.
    """

    def __init__(
        self,
        p: float = 0.5,
        scale: tuple[float, float] = (0.02, 0.33),
        ratio: tuple[float, float] = (0.3, 3.3),
        value: float = 0.0,
        key: Hashable | None = None,
    ) -> None:
        super().__init__(key)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        if not (0 < scale[0] <= scale[1] <= 1) or not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"bad scale {scale} or ratio {ratio}")
        self.p, self.scale, self.ratio, self.value = p, scale, ratio, value

    def sample(self, n: int, height: int, width: int, device: torch.device) -> torch.Tensor:
        """Per-sample ``(apply, top, left, h, w)`` as an (n, 5) int64 tensor."""
        u = torch.rand(n, 5, device=device, generator=self.generator(device))
        area = height * width * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[:, 1])
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        aspect = torch.exp(log_lo + (log_hi - log_lo) * u[:, 2])
        h = torch.sqrt(area * aspect).round().clamp(1, height)
        w = torch.sqrt(area / aspect).round().clamp(1, width)
        top = (u[:, 3] * (height - h + 1)).floor()
        left = (u[:, 4] * (width - w + 1)).floor()
        apply = (u[:, 0] < self.p).to(h.dtype)
        return torch.stack([apply, top, left, h, w], dim=1).long()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        images = _images(images, "RandomErasing")
        n, _, height, width = images.shape
        params = self.sample(n, height, width, images.device)
        apply, top, left, h, w = (params[:, i].view(n, 1, 1, 1) for i in range(5))
        rows = torch.arange(height, device=images.device).view(1, 1, height, 1)
        cols = torch.arange(width, device=images.device).view(1, 1, 1, width)
        inside = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)
        return images.masked_fill(inside & apply.bool(), self.value)
