"""Walking batch structures: apply a function to every tensor leaf, or to one chosen leaf."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["map_arrays", "map_tensors", "update_at"]


def _map_leaves(fn: Callable[[Any], Any], batch: Any, leaf: type) -> Any:
    if isinstance(batch, leaf):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {key: _map_leaves(fn, value, leaf) for key, value in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be built from a dict
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map_leaves(fn, value, leaf) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_leaves(fn, value, leaf) for value in batch)
    return batch


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """Rebuild ``batch`` with ``fn`` applied to every tensor in it.

    Walks mappings, namedtuples, lists and tuples; other leaves are returned unchanged.
    """
    return _map_leaves(fn, batch, torch.Tensor)


def map_arrays(fn: Callable[[np.ndarray], Any], batch: Any) -> Any:
    """:func:`map_tensors` for numpy arrays."""
    return _map_leaves(fn, batch, np.ndarray)


def update_at(batch: Any, key: Hashable | None, fn: Callable[[Any], Any]) -> Any:
    """Return ``batch`` with ``fn`` applied to ``batch[key]`` (to ``batch`` itself if key is None).

    Mappings are copied shallowly and sequences rebuilt, so the caller's batch is not mutated.
    """
    if key is None:
        return fn(batch)
    if isinstance(batch, Mapping):
        if key not in batch:
            raise KeyError(f"batch has no key {key!r}; it has {list(batch)}")
        updated = dict(batch)
        updated[key] = fn(batch[key])
        return updated
    if isinstance(batch, (list, tuple)) and isinstance(key, int):
        items = list(batch)
        items[key] = fn(items[key])
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):
            return type(batch)(*items)
        return type(batch)(items)
    raise TypeError(f"cannot select {key!r} in a batch of type {type(batch).__name__}")
