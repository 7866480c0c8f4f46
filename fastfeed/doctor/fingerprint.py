"""A cheap fingerprint of a batch, to tell whether two loaders gave the same batches.

Hashing every byte of every batch would cost more than loading some of them, and would slow
the runs it checks. A fingerprint takes, from each tensor or array, at most ``SAMPLES``
elements at an even stride, and keeps two sums of them: plain, and weighted by position (a
permutation changes the second). Random augmentation changes far more elements than the stride
skips, so a different batch shows. The sums stay on the tensor's device until :func:`resolve`,
so fingerprinting a CUDA batch does not wait for the GPU in the middle of a timed run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["fingerprint", "resolve"]

SAMPLES = 4096


def _tensor_sums(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    picked = flat[:: max(1, flat.numel() // SAMPLES)].to(torch.float64)
    position = torch.arange(1, picked.numel() + 1, device=picked.device, dtype=torch.float64)
    return torch.stack([picked.sum(), (picked * position).sum()])


def fingerprint(batch: Any) -> list[Any]:
    """The batch's leaves in order: ``(shape, dtype, sums)`` for tensors and arrays, ``repr``
    for anything else. Pass the result to :func:`resolve` before comparing."""
    leaves: list[Any] = []
    stack = [batch]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            leaves.append((tuple(item.shape), str(item.dtype), _tensor_sums(item)))
        elif isinstance(item, np.ndarray) and item.dtype.kind in "biuf":
            leaves.append((item.shape, str(item.dtype), _tensor_sums(torch.from_numpy(item))))
        elif isinstance(item, Mapping):
            stack.extend(item[key] for key in reversed(list(item)))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        else:
            leaves.append(repr(item))
    return leaves


def _readable(leaf: Any) -> Any:
    if isinstance(leaf, tuple):
        shape, dtype, sums = leaf
        return shape, dtype, tuple(sums.tolist())
    return leaf


def resolve(fingerprints: list[list[Any]]) -> list[tuple[Any, ...]]:
    """Comparable fingerprints: the sums read back as Python floats (a CUDA batch's, once
    the timed run is over)."""
    return [tuple(_readable(leaf) for leaf in batch) for batch in fingerprints]
