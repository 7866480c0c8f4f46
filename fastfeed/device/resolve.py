"""Which device a loader delivers to: ``device=`` checked when the loader is built, and
resolved (a bare ``"cuda"`` given its index) at the first iteration; and which GPU a script
trains on, for what watches it."""

from __future__ import annotations

import os

import torch

from fastfeed._torch_compat import has_primary_context
from fastfeed.which_gpu import local_cuda_index

__all__ = ["check_device", "resolve_device", "training_device"]


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


def training_device() -> torch.device:
    """The GPU this process trains on, for what watches it or works beside it (the doctor's GPU
    clock and sampler, the pin helper thread): a bare ``"cuda"`` as :func:`resolve_device`
    resolves it, unless that GPU has no context and another has. That is a script that moved
    its model to ``cuda:N`` and never called ``torch.cuda.set_device``: its threads' current
    device stays 0, where nothing of it runs, and anything done there would make a context (a
    few hundred MiB) on GPU 0 from every rank. Call it once the script has initialised CUDA.
    """
    try:
        resolved = resolve_device("cuda")
    except ValueError:
        # LOCAL_RANK names no GPU this process sees (a rank given several GPUs): the script
        # picks its GPUs itself.
        resolved = torch.device("cuda", torch.cuda.current_device())
    if has_primary_context(resolved.index):
        return resolved
    used = [i for i in range(torch.cuda.device_count()) if has_primary_context(i)]
    return torch.device("cuda", used[0]) if used else resolved
