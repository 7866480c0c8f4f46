"""A batch as it crosses Ray's object store: its structure pickled, its memory out of band.

A worker process hands its batch over in a pool slot or, failing that, in torch's shared
memory, by file descriptor; neither reaches another machine. An actor's batch travels as
:class:`~fastfeed.protocol.Shipped` instead: the batch pickled (protocol 5) with each plain
tensor replaced by a descriptor of its storage, and each storage (and each contiguous numpy
array) as an out-of-band buffer, which Ray writes into its object store once and never pickles.

The main process rebuilds the batch over buffers it chooses: the object store's own (read-only
views, no copy), or copies of them in a pool slot (:mod:`~fastfeed.backends.ray.landing`),
once. Views keep their storage, as torch's own pickling keeps it: ``(x, x[0])`` arrives as two
tensors over one storage.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from fastfeed._stack import bytes_are_values
from fastfeed.protocol import Shipped
from fastfeed.slots.memory import ALIGN

__all__ = ["ShippedTensor", "ship", "unship"]


class ShippedTensor(NamedTuple):
    """A plain tensor in a shipped batch: its storage's bytes (one uint8 array per storage,
    which protocol 5 hands to the pickler's ``buffer_callback``), and where the tensor lies
    in them."""

    storage: np.ndarray
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class _StorageIds:
    """The ``persistent_id`` of a shipping pickler: each plain tensor as a
    :class:`ShippedTensor`."""

    def __init__(self) -> None:
        self._storages: dict[tuple[int, int], np.ndarray] = {}
        # id -> (tensor, its descriptor): the same tensor twice is one descriptor object, which
        # pickle's memo then writes once, and the unpickler rebuilds once.
        self._seen: dict[int, tuple[torch.Tensor, ShippedTensor]] = {}

    @property
    def tensors(self) -> int:
        return len(self._seen)

    def persistent_id(self, obj: Any) -> Any:
        if not bytes_are_values(obj):
            return None
        seen = self._seen.get(id(obj))
        if seen is not None:
            return seen[1]
        storage = obj.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        memory = self._storages.get(key)
        if memory is None:
            memory = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
            self._storages[key] = memory
        pid = ShippedTensor(memory, obj.storage_offset(), tuple(obj.shape), tuple(obj.stride()),
                            obj.dtype)
        self._seen[id(obj)] = (obj, pid)
        return pid


class _ShipUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, buffers: Sequence[Any]) -> None:
        super().__init__(file, buffers=buffers)
        self._storages: dict[int, torch.Tensor] = {}  # id(storage bytes) -> a uint8 tensor
        self._rebuilt: dict[int, torch.Tensor] = {}  # id(descriptor) -> tensor
        self._arrays: list[np.ndarray] = []  # every array rebuilt over an out-of-band buffer
        self._storage_ids: set[int] = set()  # those of them that are tensors' storages

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        if module.startswith("numpy") and name == "_frombuffer":
            return self._recorded(found)
        return found

    def _recorded(self, frombuffer: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        """numpy's rebuilder of an array over an out-of-band buffer, noting what it built."""
        def rebuild(*args: Any) -> np.ndarray:
            array = frombuffer(*args)
            self._arrays.append(array)
            return array

        return rebuild

    def views(self) -> tuple[object, ...]:
        """The batch's tensors and arrays over the buffers (a tensor's storage is not one)."""
        arrays = (a for a in self._arrays if id(a) not in self._storage_ids)
        return (*self._rebuilt.values(), *arrays)

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, ShippedTensor):
            raise pickle.UnpicklingError(f"unknown fastfeed persistent id {pid!r}")
        tensor = self._rebuilt.get(id(pid))
        if tensor is None:
            self._storage_ids.add(id(pid.storage))
            raw = self._storage(pid.storage)
            raw = raw[: raw.numel() - raw.numel() % pid.dtype.itemsize].view(pid.dtype)
            tensor = self._rebuilt[id(pid)] = torch.as_strided(raw, pid.shape, pid.stride,
                                                                pid.offset)
        return tensor

    def _storage(self, memory: np.ndarray) -> torch.Tensor:
        raw = self._storages.get(id(memory))
        if raw is None:
            with warnings.catch_warnings():
                # The object store's memory is read-only; these tensors are only read (copied
                # into a slot), and torch's warning would tell the user otherwise, once.
                warnings.filterwarnings("ignore", "The given NumPy array is not writable")
                raw = self._storages[id(memory)] = torch.from_numpy(memory)
        return raw


_SHIPPING: dict[type[pickle.Pickler], type[pickle.Pickler]] = {}


def _shipping(pickler: type[pickle.Pickler]) -> type[pickle.Pickler]:
    """``pickler`` with :class:`_StorageIds` as its ``persistent_id``: a subclass, since
    Python 3.13's C pickler no longer lets an instance's ``persistent_id`` be assigned."""
    if pickler not in _SHIPPING:
        class Shipping(pickler):  # type: ignore[valid-type,misc]
            ids: _StorageIds

            def persistent_id(self, obj: Any) -> Any:
                return self.ids.persistent_id(obj)

        _SHIPPING[pickler] = Shipping
    return _SHIPPING[pickler]


def ship(batch: Any, pickler: type[pickle.Pickler] = pickle.Pickler) -> Shipped:
    """Actor side: ``batch`` as a :class:`Shipped`, without copying its memory.

    Args:
        pickler: the pickler of the structure; an actor passes Ray's cloudpickle, which
            pickles by value what the training script defined in ``__main__`` (a batch's
            namedtuple, say), as Ray pickled the dataset.
    """
    file = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    ids = _StorageIds()
    writer = _shipping(pickler)(file, protocol=5, buffer_callback=buffers.append)
    writer.ids = ids  # type: ignore[attr-defined]
    writer.dump(batch)
    required = sum(memoryview(b).nbytes for b in buffers) + ALIGN * (len(buffers) + ids.tensors)
    return Shipped(file.getvalue(), tuple(buffers), required)


def unship(shipped: Shipped, buffers: Sequence[Any] | None = None
           ) -> tuple[Any, tuple[object, ...]]:
    """Main side: the batch, its tensors and arrays views of ``buffers`` (copies of
    ``shipped.buffers``, in order; by default those buffers themselves), and those views."""
    unpickler = _ShipUnpickler(io.BytesIO(shipped.payload),
                               shipped.buffers if buffers is None else buffers)
    return unpickler.load(), unpickler.views()
