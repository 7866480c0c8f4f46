"""Walking batch structures: apply a function to every tensor leaf, or to one chosen leaf.

The walk knows mappings, namedtuples, lists, tuples and dataclasses. Any other object (an attrs
class, PyTorch Geometric's ``Batch``, a user's own container) is *opaque*: left as it is, or,
with ``deep=True``, rebuilt through pickle's reduce protocol with its leaves mapped, which is how
it crossed the process boundary in the first place (:mod:`fastfeed.codec`).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle
from collections.abc import Callable, Hashable, Mapping
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch

__all__ = ["map_arrays", "map_tensors", "update_at"]

# What cannot hold a leaf: never rebuilt, never pickled by a deep walk. The plain scalars a
# batch is full of (file names, sizes) are told apart by their exact type, at once.
_SCALARS = frozenset({str, bytes, int, float, bool, type(None)})
_ATOMIC = (str, bytes, bytearray, int, float, complex, type(None), np.generic, np.ndarray,
           torch.Tensor, torch.dtype, torch.device, type, range, slice)


def _map_leaves(fn: Callable[[Any], Any], batch: Any, leaf: type, deep: bool) -> Any:
    if isinstance(batch, leaf):
        return fn(batch)
    if type(batch) in _SCALARS:
        return batch
    if isinstance(batch, Mapping):
        items = {key: _map_leaves(fn, value, leaf, deep) for key, value in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be built from a dict
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map_leaves(fn, value, leaf, deep) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_leaves(fn, value, leaf, deep) for value in batch)
    if hasattr(type(batch), "__dataclass_fields__") and not isinstance(batch, type):
        return _map_dataclass(fn, batch, leaf, deep)
    if deep and not isinstance(batch, _ATOMIC):
        return _map_reduced(fn, batch, leaf)
    return batch


def _map_dataclass(fn: Callable[[Any], Any], batch: Any, leaf: type, deep: bool) -> Any:
    # A shallow copy with its fields replaced, as unpickling would build it: __init__ and
    # __post_init__ do not run again, and frozen or slotted classes work alike.
    mapped = copy.copy(batch)
    for field in dataclasses.fields(batch):
        object.__setattr__(mapped, field.name,
                           _map_leaves(fn, getattr(batch, field.name), leaf, deep))
    return mapped


class _LeafPickler(ForkingPickler):
    """Pickles an object with each leaf taken out of band and replaced by ``fn(leaf)``."""

    def __init__(self, file: io.BytesIO, fn: Callable[[Any], Any], leaf: type) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.fn, self.leaf = fn, leaf
        self.mapped: list[Any] = []
        self._index: dict[int, int] = {}  # a leaf met twice is mapped once, as pickle's memo would

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, self.leaf):
            return None
        index = self._index.get(id(obj))
        if index is None:
            index = self._index[id(obj)] = len(self.mapped)
            self.mapped.append(self.fn(obj))
        return index


class _LeafUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, mapped: list[Any]) -> None:
        super().__init__(file)
        self.mapped = mapped

    def persistent_load(self, pid: Any) -> Any:
        return self.mapped[pid]


def _map_reduced(fn: Callable[[Any], Any], obj: Any, leaf: type) -> Any:
    """``obj`` rebuilt through its reduce protocol with ``fn`` applied to its leaves; ``obj``
    itself when it holds none or cannot be pickled."""
    file = io.BytesIO()
    pickler = _LeafPickler(file, fn, leaf)
    try:
        pickler.dump(obj)
    except Exception:  # an object pickle cannot take (a lock, a file): walked no deeper
        return obj
    if not pickler.mapped:
        return obj
    file.seek(0)
    return _LeafUnpickler(file, pickler.mapped).load()


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any, *, deep: bool = False) -> Any:
    """Rebuild ``batch`` with ``fn`` applied to every tensor in it.

    Walks mappings, namedtuples, lists, tuples and dataclasses (fields replaced on a shallow
    copy, without calling ``__init__``). Other objects are returned unchanged, unless ``deep``:
    then an object that holds tensors is rebuilt through pickle's reduce protocol (attrs
    classes, PyTorch Geometric's ``Batch``), at the cost of pickling its structure. An object
    that cannot be pickled stays as it is.
    """
    return _map_leaves(fn, batch, torch.Tensor, deep)


def map_arrays(fn: Callable[[np.ndarray], Any], batch: Any, *, deep: bool = False) -> Any:
    """:func:`map_tensors` for numpy arrays."""
    return _map_leaves(fn, batch, np.ndarray, deep)


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
