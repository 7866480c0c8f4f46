"""``image_loader``: an ImageFolder or YOLO folder to a ready FastLoader, with a backend."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from fastfeed._imports import importable
from fastfeed._install import install_line
from fastfeed.loader import FastLoader
from fastfeed.vision.folder import ImageFolder
from fastfeed.vision.image_collate import ImageCollate, YoloCollate
from fastfeed.vision.yolo import YoloDataset

__all__ = ["BACKENDS", "choose_backend", "image_loader"]

logger = logging.getLogger("fastfeed")

BACKENDS = ("auto", "cpu", "nvjpeg", "dali")


def choose_backend(backend: str, device: Any, task: str) -> str:
    """Resolve ``"auto"``: for classification on a CUDA device, DALI if installed, else nvjpeg
    if torchvision is; otherwise cpu.

    Raises:
        ValueError: an unknown backend, or one that cannot run here (the message says why).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend should be one of {BACKENDS}, got {backend!r}")
    on_cuda = device is not None and torch.device(device).type == "cuda"
    nvjpeg_ok = on_cuda and torch.cuda.is_available() and importable("torchvision")
    dali_ok = importable("nvidia.dali")
    if backend == "auto":
        chosen = "cpu"
        if on_cuda and task == "classify":
            chosen = "dali" if dali_ok else "nvjpeg" if nvjpeg_ok else "cpu"
        logger.info("fastfeed.image_loader: backend %s (device %s)", chosen, device)
        return chosen
    if backend == "nvjpeg" and not nvjpeg_ok:
        raise ValueError("backend='nvjpeg' needs device='cuda', a GPU and torchvision")
    if backend in ("nvjpeg", "dali") and task != "classify":
        raise ValueError(f"backend={backend!r} supports task='classify' only; use 'cpu' for detect")
    if backend == "dali" and not dali_ok:
        raise ValueError(f"backend='dali' needs NVIDIA DALI: {install_line('dali')}")
    return backend


def image_loader(
    root: str | Path,
    batch_size: int,
    *,
    task: str = "classify",
    size: int = 224,
    imgsz: int = 640,
    train: bool = True,
    backend: str = "auto",
    device: Any = None,
    num_workers: int | str = "auto",
    on_error: str = "raise",
    **loader_kwargs: Any,
) -> FastLoader:
    """Build a FastLoader over an image folder (a DALI loader for ``backend="dali"``).

    Args:
        root: an ImageFolder (``task="classify"``) or a YOLO folder with ``images/`` and
            ``labels/`` (``task="detect"``).
        batch_size: samples per batch.
        task: ``"classify"``: batches ``(uint8 N×3×size×size, int64 targets)``;
            ``"detect"``: Ultralytics-style dicts with ``img`` uint8 N×3×imgsz×imgsz.
        size, imgsz: output sides for classification and detection.
        train: random augmentation and shuffling (True) or evaluation crops in order.
        backend: ``"cpu"`` (decode in workers; only the crop window of JPEGs is decoded),
            ``"nvjpeg"`` (workers read bytes, the GPU decodes; needs ``device="cuda"`` and
            torchvision), ``"dali"`` (an NVIDIA DALI pipeline with the same iteration
            interface: ``len()``, epochs, a short last batch; CPU-only mode without a GPU) or
            ``"auto"``. Every backend yields the same batch structure.
        device: deliver batches on this device (see :class:`FastLoader`).
        num_workers: an int or ``"auto"``.
        on_error: ``"raise"`` for a corrupt image (the error names the file) or ``"skip"``.
        **loader_kwargs: any other :class:`FastLoader` argument (``shuffle``, ``drop_last``,
            ``gpu_transform``, ``persistent_workers``, ...).
    """
    if task not in ("classify", "detect"):
        raise ValueError(f"task should be 'classify' or 'detect', got {task!r}")
    chosen = choose_backend(backend, device, task)
    loader_kwargs.setdefault("shuffle", train)
    if chosen == "dali":
        from fastfeed.vision.dali import DaliLoader

        return DaliLoader(root, batch_size, size=size, train=train, device=device,  # type: ignore[return-value]
                          drop_last=loader_kwargs.get("drop_last", False))
    if chosen == "nvjpeg":
        from fastfeed.vision.encoded_folder import (
            EncodedImageFolder,
            encoded_collate,
            nvjpeg_transform,
        )

        gpu_transform = nvjpeg_transform(loader_kwargs.pop("gpu_transform", None))
        return FastLoader(EncodedImageFolder(root, size, train, on_error=on_error),
                          batch_size=batch_size, num_workers=num_workers, device=device,
                          collate_fn=encoded_collate, gpu_transform=gpu_transform,
                          **loader_kwargs)
    if task == "classify":
        dataset: Any = ImageFolder(root, size, train, on_error=on_error)
        collate: Any = ImageCollate()
    else:
        dataset, collate = YoloDataset(root, imgsz, train, on_error=on_error), YoloCollate()
    return FastLoader(dataset, batch_size=batch_size, num_workers=num_workers, device=device,
                      collate_fn=collate, **loader_kwargs)
