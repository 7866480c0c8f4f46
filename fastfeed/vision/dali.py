"""The ``"dali"`` backend: an NVIDIA DALI pipeline behind FastLoader's iteration interface.

DALI reads the files, decodes (``device="mixed"``: nvJPEG on the GPU; on a machine without a
GPU, DALI's CPU-only mode), random-resized-crops, flips and lays out uint8 ``N×3×S×S`` batches,
the same structure as the ``"cpu"`` backend. Shards come from the rank and world size of
``torch.distributed`` when it is initialised. Install with ``pip install 'fastfeed[dali]'``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fastfeed.vision.folder import ImageFolder

__all__ = ["DaliLoader", "dali_available"]


def dali_available() -> bool:
    """Whether ``nvidia.dali`` imports."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


class DaliLoader:
    """Iterate an ImageFolder through DALI: ``(uint8 N×3×size×size, int64 targets)``.

    Args:
        root: the ImageFolder root (same classes and order as :class:`ImageFolder`).
        batch_size: samples per batch.
        size: output side.
        train: random-resized crop (scale 0.08–1, ratio 3/4–4/3), flip and shuffling; else the
            central 87.5 % crop in file order.
        device: ``"cuda[:N]"`` decodes on that GPU; ``None``/``"cpu"`` runs DALI's CPU-only mode.
        num_threads: DALI CPU threads.
        drop_last: drop the last partial batch (else it is returned short, as torch does).
        seed: DALI's random seed.
    """

    def __init__(self, root: str | Path, batch_size: int, *, size: int = 224, train: bool = True,
                 device: Any = None, num_threads: int = 2, drop_last: bool = False,
                 seed: int = 0) -> None:
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        folder = ImageFolder(root, size, train)
        files = [path for path, _ in folder.samples]
        rank, world = (dist.get_rank(), dist.get_world_size()) if (
            dist.is_available() and dist.is_initialized()) else (0, 1)
        on_gpu = device is not None and torch.device(device).type == "cuda"
        device_id = (torch.device(device).index or 0) if on_gpu else None
        decoder = "mixed" if on_gpu else "cpu"
        self.batch_size, self.drop_last, self.train = batch_size, drop_last, train
        self.shard_size = len(range(rank, len(files), world))
        self.device = torch.device(device) if on_gpu else torch.device("cpu")
        self.classes, self.class_to_idx = folder.classes, folder.class_to_idx

        @pipeline_def
        def pipeline():
            jpegs, labels = fn.readers.file(
                files=files, labels=folder.targets, random_shuffle=train, shard_id=rank,
                num_shards=world, name="reader")
            if train:
                images = fn.decoders.image_random_crop(
                    jpegs, device=decoder, output_type=types.RGB,
                    random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
                images = fn.resize(images, resize_x=size, resize_y=size,
                                   interp_type=types.INTERP_LINEAR, antialias=True)
                mirror = fn.random.coin_flip(probability=0.5)
            else:
                images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB)
                images = fn.resize(images, resize_shorter=round(size / 0.875),
                                   interp_type=types.INTERP_LINEAR, antialias=True)
                mirror = 0
            images = fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW",
                                               crop=(size, size), mirror=mirror)
            return images, labels

        self._pipeline = pipeline(batch_size=batch_size, num_threads=num_threads,
                                  device_id=device_id, seed=seed)
        self._pipeline.build()
        policy = LastBatchPolicy.DROP if drop_last else LastBatchPolicy.PARTIAL
        self._iterator = DALIGenericIterator([self._pipeline], ["img", "label"],
                                             reader_name="reader", last_batch_policy=policy,
                                             auto_reset=True)

    def __len__(self) -> int:
        if self.drop_last:
            return self.shard_size // self.batch_size
        return math.ceil(self.shard_size / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Accepted for DistributedSampler-style loops; DALI's reader reshuffles every epoch."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for outputs in self._iterator:
            batch = outputs[0]
            yield batch["img"], batch["label"].view(-1).long()
