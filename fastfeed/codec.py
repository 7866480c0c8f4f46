"""Batch <-> message: what crosses the process boundary instead of the data.

A worker pickles its batch with a persistent-id hook. Every CPU tensor or numpy array that
fits in the task's slot is written there (once) and replaced in the pickle by a small
descriptor: offset, shape, strides, dtype. Everything else (strings, numbers, custom objects,
and tensors that do not fit) pickles as usual, through torch's own shared-memory reductions.
The main process unpickles with the matching hook and rebuilds each descriptor as a view of a
lease on the slot. This works for any batch structure, including custom ``collate_fn`` output.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Literal

import numpy as np
import torch

from fastfeed.ring import Arena

__all__ = ["Encoded", "decode", "encode"]


@dataclass(frozen=True)
class Encoded:
    """A batch as it crosses from a worker: its slot, the pickled structure, its byte need,
    and, for a task sent without a slot, a handle on the private slot the worker wrote it to
    (:meth:`fastfeed.ring.Arena.hand_over`)."""

    slot_id: int | None
    payload: bytes
    required: int
    private_slot: Any = None


def _slot_eligible_tensor(obj: Any) -> bool:
    # Exactly torch.Tensor: subclasses and autograd leaves keep torch's own pickling.
    return (
        type(obj) is torch.Tensor
        and obj.device.type == "cpu"
        and obj.layout == torch.strided
        and not obj.requires_grad
        and not obj.is_conj()
        and not obj.is_neg()
        and not obj.is_quantized
    )


class _SlotPickler(ForkingPickler):
    def __init__(self, file: io.BytesIO, arena: Arena) -> None:
        # The default protocol, as multiprocessing's queues use: what is pickled by value
        # comes back as it does from torch's loader (numpy makes non-native byte orders
        # native below protocol 5).
        super().__init__(file)
        self._arena = arena
        self._storage_offsets: dict[tuple[int, int], int | None] = {}
        # id -> (object, its descriptor): pickle's memo comes after persistent_id, so an object
        # met twice is remembered here, and rebuilt once (as the same object, as pickle does).
        self._seen: dict[int, tuple[Any, tuple]] = {}

    def persistent_id(self, obj: Any) -> Any:
        seen = self._seen.get(id(obj))
        if seen is not None:
            return seen[1]
        if _slot_eligible_tensor(obj):
            pid = self._tensor_id(obj)
        elif type(obj) is np.ndarray and not obj.dtype.hasobject:
            pid = self._array_id(obj)
        else:
            return None
        if pid is not None:
            pid = (pid[0], len(self._seen), *pid[1:])  # a serial number: the object's identity
            self._seen[id(obj)] = (obj, pid)
        return pid

    def _tensor_id(self, tensor: torch.Tensor) -> tuple | None:
        storage = tensor.untyped_storage()
        if self._arena.owns(tensor):
            base = 0  # stacked into the slot by the collate step: no copy at all
        elif storage.is_shared():
            return None  # already in shared memory (torch's collate did it): send its handle
        else:
            # Copy the whole storage once, so that views sharing it still share it after. Two
            # storages may start at one address with different sizes (two from_numpy views).
            key = (storage.data_ptr(), storage.nbytes())
            if key not in self._storage_offsets:
                self._storage_offsets[key] = self._copy_storage(storage)
            offset = self._storage_offsets[key]
            if offset is None:
                return None
            base = offset
        byte_offset = base + tensor.storage_offset() * tensor.element_size()
        return ("tensor", byte_offset, tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)

    def _copy_storage(self, storage: torch.UntypedStorage) -> int | None:
        nbytes = storage.nbytes()
        offset = self._arena.allocate(nbytes)
        if offset is not None and nbytes:
            assert self._arena.buffer is not None
            source = torch.empty(0, dtype=torch.uint8).set_(storage)
            self._arena.buffer[offset : offset + nbytes].copy_(source)
        return offset

    def _array_id(self, array: np.ndarray) -> tuple | None:
        if not array.dtype.isnative:
            return None  # numpy's own pickling makes it native: keep exactly what it gives
        offset = self._arena.allocate(array.nbytes)
        if offset is None:
            return None
        assert self._arena.buffer is not None
        dest = self._arena.buffer[offset : offset + array.nbytes].numpy()
        # Fortran order survives, as it does numpy's pickling; other layouts become C order.
        fortran = array.flags.f_contiguous and not array.flags.c_contiguous
        order: Literal["C", "F"] = "F" if fortran else "C"
        np.copyto(np.ndarray(array.shape, array.dtype, buffer=dest, order=order), array)
        # The dtype itself: its string form loses a structured dtype's fields.
        return ("array", offset, array.shape, array.dtype, order)


class _MeasuringPickler(_SlotPickler):
    """Counts the bytes the batch's arrays would take in a slot, without pickling any of
    them: torch's own reductions would move storages into shared memory, for nothing."""

    def persistent_id(self, obj: Any) -> Any:
        super().persistent_id(obj)
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            return "measured"
        if isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
            return "measured"  # an object array is pickled by element: its tensors count
        return None


def _slot_bytes_needed(batch: Any) -> int:
    arena = Arena()
    _MeasuringPickler(io.BytesIO(), arena).dump(batch)
    return arena.required


def encode(batch: Any, arena: Arena) -> Encoded:
    """Worker side: write ``batch``'s arrays into ``arena`` and pickle the rest.

    An arena without memory (the task came without a slot, and the worker has not seen a
    batch yet) is replaced by a private slot of the size the batch needs.
    """
    if arena.buffer is None:
        needed = _slot_bytes_needed(batch)
        if needed:
            arena = Arena.private(needed)
    file = io.BytesIO()
    _SlotPickler(file, arena).dump(batch)
    return Encoded(arena.slot_id, file.getvalue(), arena.required, arena.hand_over())


class _SlotUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, lease: np.ndarray | None) -> None:
        super().__init__(file)
        self._lease = lease
        self._base = None if lease is None else torch.from_numpy(lease)
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._rebuilt: dict[int, Any] = {}  # serial -> object

    def persistent_load(self, pid: Any) -> Any:
        serial = pid[1]
        if serial not in self._rebuilt:
            self._rebuilt[serial] = self._rebuild(pid)
        return self._rebuilt[serial]

    def _rebuild(self, pid: tuple) -> Any:
        kind = pid[0]
        if kind == "tensor":
            _, _, byte_offset, shape, stride, dtype = pid
            typed = self._typed.get(dtype)
            if typed is None:
                assert self._base is not None
                typed = self._typed[dtype] = self._base.view(dtype)
            return torch.as_strided(typed, shape, stride, byte_offset // dtype.itemsize)
        if kind == "array":
            _, _, offset, shape, dtype, order = pid
            assert self._lease is not None
            count = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if dtype.itemsize == 0:  # frombuffer refuses such dtypes; there are no bytes anyway
                return np.empty(shape, dtype)
            # Over a memoryview of the lease, which holds the lease itself: numpy collapses a
            # chain of array views past the lease, and a tensor's memory can be moved away
            # (share_memory_(), a torch.multiprocessing queue) and the lease with it.
            window = self._lease.data[offset : offset + count]  # a memoryview of the lease
            return np.frombuffer(window, dtype=dtype).reshape(shape, order=order)
        raise pickle.UnpicklingError(f"unknown fastfeed persistent id {kind!r}")


def decode(message: Encoded, lease: np.ndarray | None) -> Any:
    """Main side: rebuild the batch; its arrays are views of ``lease``, the slot's memory
    (see :meth:`fastfeed.ring.SlotRing.lease`), which they keep alive."""
    return _SlotUnpickler(io.BytesIO(message.payload), lease).load()
