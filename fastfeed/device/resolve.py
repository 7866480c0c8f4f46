"""Which device a loader delivers to: ``device=`` checked when the loader is built, and
resolved (a bare ``"cuda"`` given its index) at the first iteration."""

from __future__ import annotations

import os

import torch

from fastfeed.which_gpu import local_cuda_index

__all__ = ["check_device", "resolve_device"]


def check_device(device: str | int | torch.device) -> torch.device:
    """Parse ``device`` and check that this machine has it, without initialising CUDA.

    Raises:
        ValueError: the string is not a device, or CUDA is requested but unavailable.
    """
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device={device!r} is not a valid torch device: {error}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} was requested but CUDA is not available "
            "(torch.cuda.is_available() is False); use device='cpu' or None"
        )
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: fastfeed prefetches to 'cpu' or 'cuda' devices")
    return resolved


def resolve_device(device: str | int | torch.device) -> torch.device:
    """:func:`check_device`, with the index of this process's GPU filled in.

    A bare ``"cuda"`` means the GPU the process sees, when it sees only one (a launcher that
    sets ``CUDA_VISIBLE_DEVICES`` per rank); else the device the script chose with
    ``torch.cuda.set_device`` (any but 0), else ``LOCAL_RANK``'s GPU (torchrun), else GPU 0
    (see :func:`fastfeed.which_gpu.local_cuda_index`). Call it when the training script has
    chosen its device, not before.

    Raises:
        ValueError: the string is not a device, CUDA is requested but unavailable, or the
            index does not name a device this process sees.
    """
    resolved = check_device(device)
    if resolved.type != "cuda":
        return resolved
    current = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    index = local_cuda_index(resolved.index, os.environ.get("LOCAL_RANK"),
                             torch.cuda.device_count(), current)
    return torch.device("cuda", index)
