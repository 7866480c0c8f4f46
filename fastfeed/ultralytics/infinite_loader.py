"""``InfiniteFastLoader``: a FastLoader with the contract of Ultralytics' ``InfiniteDataLoader``."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

from fastfeed.loader import FastLoader

__all__ = ["InfiniteFastLoader"]


class _RepeatBatches:
    """Yields the batches of ``batch_sampler`` epoch after epoch, forever."""

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield from iter(self.batch_sampler)

    def __len__(self) -> int:
        return len(self.batch_sampler)


class InfiniteFastLoader(FastLoader):
    r"""A :class:`~fastfeed.FastLoader` that behaves as Ultralytics' ``InfiniteDataLoader``.

    One iterator serves every epoch: its batch sampler repeats forever, so workers start once
    and each ``for`` loop over the loader takes the next ``len(loader)`` batches from it. The
    random draws are the stock loader's: the base seed is drawn once, the sampler draws again
    at every epoch.

    Ultralytics calls :meth:`reset` after changing the dataset (mosaic is switched off for the
    last ``close_mosaic`` epochs), so that new workers see the change, and :meth:`close` when
    training ends.

    Takes :class:`~fastfeed.FastLoader`'s arguments; a subclass made by
    :func:`fastfeed.ultralytics.patch` adds its ``fastloader_options`` to them, and with
    ``augment_device`` moves the per-pixel augmentation of a training dataset there
    (:mod:`fastfeed.ultralytics.gpu_augment`).
    """

    fastloader_options: ClassVar[dict[str, Any]] = {}
    augment_device: ClassVar[str | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        options = {**self.fastloader_options, **kwargs}
        dataset = args[0] if args else options.get("dataset")
        options = _with_slot_images(dataset, options, self.augment_device)
        super().__init__(*args, **options)
        if self.batch_sampler is None:
            raise ValueError("InfiniteFastLoader needs batches: pass a batch_size")
        # DataLoader forbids setting batch_sampler after __init__; Ultralytics does the same.
        object.__setattr__(self, "batch_sampler", _RepeatBatches(self.batch_sampler))
        self.iterator: Any = None

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self.iterator is None:
            self.iterator = super().__iter__()
        for _ in range(len(self)):
            yield next(self.iterator)

    def close(self) -> None:
        """Stop the workers and drop the batches they prepared."""
        iterator, self.iterator = self.iterator, None
        if iterator is not None and hasattr(iterator, "close"):
            iterator.close()

    def reset(self) -> None:
        """Start new workers on the next epoch, so that they see a changed dataset."""
        self.close()


def _with_slot_images(dataset: Any, options: dict[str, Any], augment_device: str | None
                      ) -> dict[str, Any]:
    """``options`` whose collate gathers the images into the pool slot, and, with
    ``augment_device``, whose workers leave the pixel work to that device where it qualifies."""
    from fastfeed.ultralytics import gpu_augment, slot_collate

    collate_fn, init = options.get("collate_fn"), options.get("worker_init_fn")
    if collate_fn is None or not slot_collate.gathers_images(dataset, collate_fn):
        return options
    if augment_device is not None:
        reason = gpu_augment.unsupported_reason(dataset)
        if reason is None and not options.get("num_workers"):
            reason = "it runs without workers, which record the parameters"
        if reason is None:
            return {**options, "device": augment_device,
                    "gpu_transform": gpu_augment.PixelOps(),
                    "worker_init_fn": slot_collate.InWorkers(gpu_augment.defer_pixel_ops, init),
                    "collate_fn": gpu_augment.CanvasCollate(collate_fn)}
        if getattr(dataset, "augment", False):  # validation loaders are expected to stay put
            warnings.warn(f"fastfeed: Ultralytics' augmentation stays on the CPU: {reason}",
                          RuntimeWarning, stacklevel=3)
    return {**options, "worker_init_fn": slot_collate.InWorkers(prepare_worker, init),
            "collate_fn": slot_collate.SlotCollate(collate_fn)}


def prepare_worker(dataset: Any) -> None:
    """In a worker: ``Format`` hands its images to the slot collate, and mosaics that go
    straight to the warp are laid out only where it reads them."""
    from fastfeed.ultralytics import mosaic, slot_collate

    slot_collate.format_into_slot(dataset)
    mosaic.defer_canvases(dataset)
