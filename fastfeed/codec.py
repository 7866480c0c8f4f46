"""Batch <-> message: what crosses the process boundary instead of the data.

A worker pickles its batch with a persistent-id hook. Every CPU tensor or numpy array that
fits in the task's slot is written there (once) and replaced in the pickle by a small
descriptor: offset, shape, strides, dtype. Everything else (strings, numbers, custom objects,
and tensors that do not fit) pickles as usual, through torch's own shared-memory reductions.
The main process unpickles with the matching hook and rebuilds each descriptor as a view of a
lease on the slot. This works for any batch structure, including custom ``collate_fn`` output.

The descriptors (persistent ids) are typed: :class:`SlotTensor` and :class:`SlotArray` (a
region of the slot), :class:`ToPlace` (a tensor placed once the whole batch is seen, whose
descriptor travels in ``Encoded.placed``) and :class:`Unplaced` (one that did not fit).
"""

from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from fastfeed._stack import bytes_are_values
from fastfeed.protocol import Encoded
from fastfeed.slots.arena import Arena
from fastfeed.slots.pool import Lease

__all__ = ["SlotArray", "SlotTensor", "ToPlace", "Unplaced", "decode", "decode_if_encoded",
           "encode", "slot_bytes_needed"]


# A storage up to this many times larger than the bytes a batch views of it is copied whole
# (views that share it keep sharing it); a larger one, only the parts the batch views.
_WHOLE_STORAGE_LIMIT = 4


class SlotTensor(NamedTuple):
    """A tensor over bytes ``[region, region + length)`` of the slot, starting
    ``element_offset`` elements in. ``serial`` is its identity in the batch: every
    descriptor with that serial is rebuilt as the same object."""

    serial: int
    region: int
    length: int
    element_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class SlotArray(NamedTuple):
    """A numpy array at byte ``offset`` of the slot, in C or Fortran order."""

    serial: int
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype
    order: Literal["C", "F"]


class ToPlace(NamedTuple):
    """A tensor placed in the slot once the whole batch is seen; its descriptor is under
    ``serial`` in the placed table (``Encoded.placed``)."""

    serial: int


class Unplaced(NamedTuple):
    """In the placed table: a tensor that did not fit in the slot, pickled by torch's own
    reductions."""

    tensor: torch.Tensor


class _Counted(NamedTuple):
    """What a measuring pickler writes for an array it counted (never unpickled)."""


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """``(first byte, bytes)`` of the tensor's elements in its storage."""
    itemsize = tensor.element_size()
    first = int(tensor.storage_offset()) * itemsize
    if tensor.numel() == 0:
        return first, 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(),
                                                                 strict=True))
    return first, span * itemsize


def _merged(extents: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, length)`` spans covering ``extents``, overlapping or touching ones as one."""
    spans: list[list[int]] = []
    for first, length in sorted(extents):
        if spans and first <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], first + length)
        else:
            spans.append([first, first + length])
    return [(start, end - start) for start, end in spans]


class _SlotPickler(ForkingPickler):
    """Pickles a batch with its arrays replaced by descriptors of slot regions.

    Tensors the collate step stacked into the slot are described at once. Other tensors are
    *placed* after the whole batch is seen (:meth:`place_tensors`): only then is it known
    which parts of each storage the batch views, so that views of one storage stay views of
    one region (``(x, x[0])``: ``x[0]`` is a view of ``x``), whatever their order.
    """

    def __init__(self, file: io.BytesIO, arena: Arena) -> None:
        # The default protocol, as multiprocessing's queues use: what is pickled by value
        # comes back as it does from torch's loader (numpy makes non-native byte orders
        # native below protocol 5).
        super().__init__(file)
        self._arena = arena
        # id -> (object, its descriptor): pickle's memo comes after persistent_id, so an object
        # met twice is remembered here, and rebuilt once (as the same object, as pickle does).
        self._seen: dict[int, tuple[Any, SlotTensor | SlotArray | ToPlace]] = {}
        # (storage address, storage bytes) -> [(serial, tensor)]: the tensors to place.
        # Two storages may start at one address with other sizes.
        self._to_place: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}

    def persistent_id(self, obj: Any) -> Any:
        # pickle asks this of every object it meets, the ints and tuples of each descriptor
        # included: only exact tensors and arrays can have one.
        cls = type(obj)
        if cls is not torch.Tensor and cls is not np.ndarray:
            return None
        seen = self._seen.get(id(obj))
        if seen is not None:
            return seen[1]
        serial = len(self._seen)  # the object's identity in this batch
        pid: SlotTensor | SlotArray | ToPlace | None
        if bytes_are_values(obj):
            pid = self._tensor_id(obj, serial)
        elif type(obj) is np.ndarray and not obj.dtype.hasobject:
            pid = self._array_id(obj, serial)
        else:
            return None
        if pid is not None:
            self._seen[id(obj)] = (obj, pid)
        return pid

    def _tensor_id(self, tensor: torch.Tensor, serial: int) -> SlotTensor | ToPlace | None:
        if self._arena.owns(tensor):  # stacked into the slot by the collate step: no copy
            first, length = _extent(tensor)
            return SlotTensor(serial, first, length, 0, tuple(tensor.shape),
                              tuple(tensor.stride()), tensor.dtype)
        storage = tensor.untyped_storage()
        if storage.is_shared():
            return None  # already in shared memory (torch's collate did it): send its handle
        key = (storage.data_ptr(), storage.nbytes())
        self._to_place.setdefault(key, []).append((serial, tensor))
        return ToPlace(serial)

    def place_tensors(self) -> dict[int, SlotTensor | Unplaced]:
        """Copy the tensors met outside the slot into it: per storage, the whole storage when
        the batch views a good part of it, else each span the batch views (a row of a dataset's
        big tensor is copied alone). Returns each one's descriptor by serial (:class:`Unplaced`
        for one that did not fit)."""
        placed: dict[int, SlotTensor | Unplaced] = {}
        for tensors in self._to_place.values():
            storage = tensors[0][1].untyped_storage()
            extents = {serial: _extent(tensor) for serial, tensor in tensors}
            spans = _merged(list(extents.values()))
            if storage.nbytes() <= _WHOLE_STORAGE_LIMIT * max(sum(n for _, n in spans), 1):
                spans = [(0, storage.nbytes())]
            for start, length in spans:
                region = self._copy_bytes(storage, start, length)
                for serial, tensor in tensors:
                    first, nbytes = extents[serial]
                    if not start <= first <= first + nbytes <= start + length:
                        continue
                    placed[serial] = Unplaced(tensor) if region is None else SlotTensor(
                        serial, region, length, (first - start) // tensor.element_size(),
                        tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        return placed

    def _copy_bytes(self, storage: torch.UntypedStorage, start: int, length: int) -> int | None:
        offset = self._arena.allocate(length)
        if offset is not None and length:
            assert self._arena.buffer is not None
            source = torch.empty(0, dtype=torch.uint8).set_(storage)[start : start + length]
            self._arena.buffer[offset : offset + length].copy_(source)
        return offset

    def _array_id(self, array: np.ndarray, serial: int) -> SlotArray | None:
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
        return SlotArray(serial, offset, array.shape, array.dtype, order)


class _MeasuringPickler(_SlotPickler):
    """Counts the bytes the batch's arrays would take in a slot, without pickling any of
    them: torch's own reductions would move storages into shared memory, for nothing."""

    def persistent_id(self, obj: Any) -> Any:
        super().persistent_id(obj)
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            return _Counted()
        if isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
            return _Counted()  # an object array is pickled by element: its tensors count
        return None


def slot_bytes_needed(batch: Any) -> int:
    """The bytes :func:`encode` writes of ``batch`` into a slot large enough for it."""
    arena = Arena()
    pickler = _MeasuringPickler(io.BytesIO(), arena)
    pickler.dump(batch)
    pickler.place_tensors()
    return arena.required


def encode(batch: Any, arena: Arena) -> Encoded:
    """Worker side: write ``batch``'s arrays into ``arena`` and pickle the rest.

    An arena without memory (the task came without a slot, and the worker has not seen a
    batch yet) is replaced by a private slot of the size the batch needs.
    """
    if arena.buffer is None:
        needed = slot_bytes_needed(batch)
        if needed:
            arena = Arena.private(needed)
    file = io.BytesIO()
    pickler = _SlotPickler(file, arena)
    pickler.dump(batch)
    placed = pickler.place_tensors()
    return Encoded(arena.slot_id, file.getvalue(), arena.required, arena.export_private_slot(),
                   bytes(ForkingPickler.dumps(placed)) if placed else b"")


class _SlotUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, lease: np.ndarray | None,
                 placed: dict[int, SlotTensor | Unplaced]) -> None:
        super().__init__(file)
        self._lease = lease
        self._placed = placed
        self._storages: dict[tuple[int, int], torch.Tensor] = {}
        self._rebuilt: dict[int, Any] = {}  # serial -> object
        self.views: list[Any] = []  # the objects rebuilt over the lease

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, (SlotTensor, SlotArray, ToPlace)):
            raise pickle.UnpicklingError(f"unknown fastfeed persistent id {pid!r}")
        serial = pid.serial
        if serial not in self._rebuilt:
            self._rebuilt[serial] = self._rebuild(pid)
        return self._rebuilt[serial]

    def _storage(self, region: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor over bytes ``[region, region + length)`` of the slot, one per region: each
        leaf gets a storage of its own size (``torch.save`` of a label writes the label, not
        the slot), and views of one storage in the worker share one here. It holds the lease
        through a memoryview of it (numpy would collapse a view past the lease)."""
        raw = self._storages.get((region, length))
        if raw is None:
            if length == 0:
                raw = torch.empty(0, dtype=torch.uint8)
            else:
                assert self._lease is not None
                raw = torch.frombuffer(self._lease.data[region : region + length],
                                       dtype=torch.uint8)
            self._storages[(region, length)] = raw
        # A storage of one dtype may be viewed as a wider one over fewer bytes than its all.
        return raw[: length - length % dtype.itemsize].view(dtype)

    def _rebuild(self, pid: SlotTensor | SlotArray | ToPlace) -> Any:
        if isinstance(pid, ToPlace):
            placed = self._placed[pid.serial]
            if isinstance(placed, Unplaced):
                return placed.tensor
            pid = placed
        if isinstance(pid, SlotTensor):
            view: Any = torch.as_strided(self._storage(pid.region, pid.length, pid.dtype),
                                         pid.shape, pid.stride, pid.element_offset)
        else:
            offset, shape, dtype = pid.offset, pid.shape, pid.dtype
            assert self._lease is not None
            count = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if dtype.itemsize == 0:  # frombuffer refuses such dtypes; there are no bytes anyway
                return np.empty(shape, dtype)
            # Over a memoryview of the lease, which holds the lease itself: numpy collapses a
            # chain of array views past the lease, and a tensor's memory can be moved away
            # (share_memory_(), a torch.multiprocessing queue) and the lease with it.
            window = self._lease.data[offset : offset + count]  # a memoryview of the lease
            view = np.frombuffer(window, dtype=dtype).reshape(shape, order=pid.order)
        self.views.append(view)
        return view


def decode_if_encoded(batch: Any, lease: Lease | None) -> Any:
    """``batch`` rebuilt by :func:`decode` if it is an :class:`Encoded` message, else as it is
    (a batch that crossed by torch's own path, or never crossed)."""
    return decode(batch, lease) if isinstance(batch, Encoded) else batch


def decode(message: Encoded, lease: Lease | None) -> Any:
    """Main side: rebuild the batch; its arrays are views of the lease's memory (see
    :meth:`fastfeed.slots.SlotPool.lease`), which they keep alive, and the lease records them
    (:attr:`Lease.views <fastfeed.slots.Lease>`)."""
    memory = None if lease is None else lease.memory
    placed = pickle.loads(message.placed) if message.placed else {}
    unpickler = _SlotUnpickler(io.BytesIO(message.payload), memory, placed)
    batch = unpickler.load()
    if lease is not None:
        lease.views = tuple(unpickler.views)
    return batch
