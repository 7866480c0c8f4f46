"""The ``"dali"`` backend: an NVIDIA DALI pipeline behind FastLoader's iteration interface.

DALI reads the files, decodes (``device="mixed"``: nvJPEG on the GPU; on a machine without a
GPU, DALI's CPU-only mode), random-resized-crops, flips and lays out uint8 ``N×3×S×S`` batches,
the same structure as the ``"cpu"`` backend, with the targets on the images' device. Shards
come from the rank and world size of ``torch.distributed`` when it is initialised; every rank
yields the same number of batches (:func:`epoch_batches`), as DistributedSampler's ranks do, so
that DDP's collectives never wait on a rank that has finished its epoch. Install with
the line ``python -m fastfeed info`` prints for it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fastfeed.device import check_device, resolve_device
from fastfeed.vision.folder import ImageFolder

__all__ = ["DaliLoader", "epoch_batches", "rank_seed"]


def epoch_batches(samples: int, world_size: int, batch_size: int, drop_last: bool
                  ) -> tuple[int, int]:
    """Batches per epoch in every rank, and the size of the last one, for DALI's sharding.

    DALI's reader splits ``samples`` into ``world_size`` contiguous shards of
    ``floor(samples / world_size)`` or one more, and moves every rank to the next shard each
    epoch. With ``pad_last_batch=True`` it pads each shard with copies of its last sample to
    whole batches of the largest shard, so every rank runs the same number of iterations:

    - ``drop_last``: as many whole batches as the smallest shard fills;
    - else: as many as the largest shard needs, the last one cut to where the largest shard
      ends. A smaller shard's last batch then ends with one copy of its last sample, as
      DistributedSampler repeats samples to give every rank as many.

    Returns:
        ``(batches, last_batch_size)``; ``(0, 0)`` when there are none.
    """
    smallest, largest = samples // world_size, -(-samples // world_size)
    if drop_last:
        batches = smallest // batch_size
        return batches, batch_size if batches else 0
    batches = math.ceil(largest / batch_size)
    return batches, largest - (batches - 1) * batch_size if batches else 0


def rank_seed(seed: int, rank: int) -> int:
    """DALI's seed for ``rank``: distinct per rank, so that ranks draw different crops and flips
    and shuffle their shards differently; a pure function of ``(seed, rank)``, for restarts."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0] & 0x7FFFFFFF)


def _graph(files: list[str], targets: list[int], shard: tuple[int, int], size: int, train: bool,
           on_gpu: bool) -> tuple:
    """DALI's operators, inside a pipeline: ``(images, labels)`` of shard ``(rank, world)``,
    both on the GPU when decoding there (else the loss would meet GPU images with CPU
    targets)."""
    from nvidia.dali import fn, types

    decoder = "mixed" if on_gpu else "cpu"
    jpegs, labels = fn.readers.file(
        files=files, labels=targets, random_shuffle=train, shard_id=shard[0],
        num_shards=shard[1], pad_last_batch=True, name="reader")
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
    return images, labels.gpu() if on_gpu else labels


class DaliLoader:
    """Iterate an ImageFolder through DALI: ``(uint8 N×3×size×size, int64 targets)``.

    Args:
        root: the ImageFolder root (same classes and order as :class:`ImageFolder`).
        batch_size: samples per batch.
        size: output side.
        train: random-resized crop (scale 0.08–1, ratio 3/4–4/3), flip and shuffling; else the
            central 87.5 % crop in file order.
        device: ``"cuda[:N]"`` decodes on that GPU (a bare ``"cuda"``: this process's GPU,
            resolved as :class:`~fastfeed.FastLoader` resolves it, at the first iteration);
            ``None``/``"cpu"`` runs DALI's CPU-only mode.
        num_threads: DALI CPU threads.
        drop_last: drop the last partial batch (else it is returned short, as torch does).
        seed: the base of DALI's random seed (each rank draws from its own, :func:`rank_seed`).
        rank, world_size: this process's shard; default: ``torch.distributed``'s, else one.

    Every ``iter()`` starts an epoch of ``len()`` batches, as torch's loaders do. DALI cannot
    restart an epoch early, so when a loop left the last one unfinished (a ``break``,
    Lightning's sanity check, ``limit_train_batches``), its rest is read and dropped first:
    that costs its decode, and keeps every rank on DALI's epoch and shard.
    """

    def __init__(self, root: str | Path, batch_size: int, *, size: int = 224, train: bool = True,
                 device: Any = None, num_threads: int = 2, drop_last: bool = False,
                 seed: int = 0, rank: int | None = None, world_size: int | None = None) -> None:
        folder = ImageFolder(root, size, train)
        files = [path for path, _ in folder.samples]
        distributed = dist.is_available() and dist.is_initialized()
        rank = rank if rank is not None else dist.get_rank() if distributed else 0
        world_size = (world_size if world_size is not None
                      else dist.get_world_size() if distributed else 1)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        # Which GPU a bare "cuda" means is decided when the pipeline is built, at the first
        # iteration: a script may call torch.cuda.set_device after making the loader.
        self.device = check_device(device) if device is not None else torch.device("cpu")
        self.batch_size, self.drop_last, self.train = batch_size, drop_last, train
        self.classes, self.class_to_idx = folder.classes, folder.class_to_idx
        self.seed = rank_seed(seed, rank)
        self._batches, self._last_size = epoch_batches(len(files), world_size, batch_size,
                                                       drop_last)
        if self._batches == 0:  # DALI would fail later, with a less direct message
            raise ValueError(f"{len(files)} images in {world_size} shard(s) fill no batch of "
                             f"{batch_size}{' (drop_last=True)' if drop_last else ''}")
        self._graph_args = (files, folder.targets, (rank, world_size), size, train)
        self._num_threads = num_threads
        self._iterator: Any = None  # DALI's, built at the first iteration
        self._epoch_done = True  # whether DALI's current epoch was read to its end

    def __len__(self) -> int:
        return self._batches

    def set_epoch(self, epoch: int) -> None:
        """Accepted for DistributedSampler-style loops; DALI's reader reshuffles every epoch."""

    def _dali_iterator(self) -> Any:
        if self._iterator is not None:
            return self._iterator
        from nvidia.dali import pipeline_def
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        on_gpu = self.device.type == "cuda"
        if on_gpu:
            self.device = resolve_device(self.device)

        @pipeline_def
        def pipeline():
            return _graph(*self._graph_args, on_gpu)

        built = pipeline(batch_size=self.batch_size, num_threads=self._num_threads,
                         device_id=self.device.index if on_gpu else None, seed=self.seed)
        built.build()
        # FILL on padded shards: every batch whole, the padding cut off in __iter__. Also with
        # drop_last: DALI's DROP ends the iterator's epoch before the reader's, whose padded
        # rest then came out as the next epoch's first batch (one sample, repeated).
        self._iterator = DALIGenericIterator([built], ["img", "label"], reader_name="reader",
                                             last_batch_policy=LastBatchPolicy.FILL,
                                             auto_reset=True)
        return self._iterator

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        iterator = self._dali_iterator()
        if not self._epoch_done:
            # The rest of the epoch a loop left: DALI resets only at an epoch's end (read with
            # next(), as iter() asks DALI for a reset it refuses mid-epoch).
            while next(iterator, None) is not None:
                pass
        self._epoch_done = False
        for step, outputs in enumerate(iterator):
            if step >= self._batches:
                continue  # drop_last: the partial batch and padding, read to end the epoch
            batch = outputs[0]
            images, labels = batch["img"], batch["label"].view(-1).long()
            if step == self._batches - 1:
                images, labels = images[:self._last_size], labels[:self._last_size]
            yield images, labels
        self._epoch_done = True
