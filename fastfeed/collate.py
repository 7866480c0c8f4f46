"""``default_collate`` that stacks straight into a ring slot.

The structure of the result is torch's own (``collate_with`` reuses torch's walker), so a batch
collated here equals ``default_collate``'s bit for bit; only where the stacked tensors live
differs. Tensors that cannot take the fast path (mixed shapes or dtypes, subclasses, autograd
leaves, nested or sparse layouts) go to torch's ``collate_tensor_fn``, which raises torch's errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from fastfeed._copy import stack_into
from fastfeed._torch_compat import collate_tensor_fn, collate_with
from fastfeed.ring import Arena

__all__ = ["collate_into", "stackable"]


def stackable(samples: Sequence[Any]) -> bool:
    """Whether ``samples`` are plain CPU tensors of one shape and dtype (the fast stack)."""
    first = samples[0]
    return all(
        type(s) is torch.Tensor
        and s.dtype == first.dtype
        and s.shape == first.shape
        and s.is_cpu  # a fifth of the cost of s.device.type, paid per sample
        and s.layout == torch.strided
        and not s.requires_grad
        and not s.is_conj()  # lazy conjugate and negative views: their bytes are not their values
        and not s.is_neg()
        for s in samples
    )


def _stack_into_arena(
    arena: Arena, samples: Sequence[torch.Tensor], *, collate_fn_map: Any = None
) -> torch.Tensor:
    if stackable(samples):
        shape, dtype = (len(samples), *samples[0].shape), samples[0].dtype
        # Without a slot (a worker's first batch), private memory: the codec moves the batch
        # into a slot of the worker's own, which the ring keeps. torch's collate would put it
        # in shared memory that dies with the batch.
        out = torch.empty(shape, dtype=dtype) if arena.buffer is None else arena.empty(shape, dtype)
        if out is not None:
            stack_into(out, samples)
            return out
    return collate_tensor_fn(samples, collate_fn_map=collate_fn_map)


def collate_into(samples: list, arena: Arena) -> Any:
    """Collate ``samples`` exactly as ``default_collate`` would, with tensors in ``arena``."""
    return collate_with(samples, partial(_stack_into_arena, arena))
