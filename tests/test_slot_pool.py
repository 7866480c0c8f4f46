"""Slot lifetime (docs/design.md, invariant 2) and the slot pool's fallbacks."""

import gc
import os

import numpy as np
import pytest
import torch
from helpers import assert_same, compare
from procs import assert_no_leaks, snapshot
from sample_datasets import DetectionDataset, TensorDataset, detection_collate
from torch.utils.data import DataLoader, Dataset

from fastfeed import FastLoader
from fastfeed.slots import SlotPool
from fastfeed.vision.image_collate import ImageCollate


def clone(batch):
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, np.ndarray):
        return batch.copy()
    if isinstance(batch, dict):
        return {k: clone(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(clone(v) for v in batch)
    return batch


def slot_pool_of(loader):
    return loader._planner.slot_pool


def in_a_slot(loader, leaf):
    """Whether a tensor or array leaf lives in one of the loader's pool slots."""
    address = leaf.data_ptr() if isinstance(leaf, torch.Tensor) else leaf.ctypes.data
    slots = slot_pool_of(loader)._slots.values()
    return any(s.address <= address < s.address + s.nbytes for s in slots)


MODES = pytest.mark.parametrize("worker_mode", ["process", "thread"])


@MODES
def test_batches_are_views_of_pool_slots(worker_mode):
    loader = FastLoader(TensorDataset(n=64), batch_size=4, num_workers=2, persistent_workers=True,
                        worker_mode=worker_mode)
    list(loader)  # the first epoch learns the slot size
    in_slot = [in_a_slot(loader, b[0]) for b in loader]
    assert all(in_slot), in_slot


def test_a_short_first_epoch_leaves_the_slot_pool_grown():
    # The first tasks go out before the slot pool knows the batch size. Their workers write the
    # batches into slots of their own, which the slot pool keeps: the next epoch finds them with
    # their pages faulted in, instead of growing (and faulting in) the slot pool again.
    loader = FastLoader(TensorDataset(n=20), batch_size=4, num_workers=2, persistent_workers=True)
    first = list(loader)  # 5 batches, 4 of them sent at once
    slot_pool = slot_pool_of(loader)
    in_slot = [in_a_slot(loader, b[0]) for b in first]
    assert all(in_slot), in_slot
    assert slot_pool.occupancy == (5, 5)
    assert_same(first, list(DataLoader(TensorDataset(n=20), batch_size=4, num_workers=2)))
    del first
    gc.collect()
    list(loader)
    assert slot_pool.occupancy[1] <= slot_pool.max_slots


def test_a_batch_sent_without_a_slot_is_sized_without_touching_shared_memory():
    from fastfeed.codec import decode, encode
    from fastfeed.slots import Arena

    batch = {"x": torch.arange(1000.0).view(10, 100), "y": np.arange(7), "name": "a"}
    message = encode(batch, Arena())
    assert not batch["x"].is_shared()  # sized by a dry run, not moved by torch's reduction
    slot_pool = SlotPool(2, slot_bytes=message.required)
    lease, created = slot_pool.adopt(message.private_slot.detach())
    assert len(created) == 1
    assert_same(decode(message, lease), batch)
    # The tensors inside an object array are counted too (it is pickled element by element).
    boxed = np.empty(2, dtype=object)
    boxed[0], boxed[1] = batch["x"], batch["y"]
    boxed_message = encode(boxed, Arena())
    os.close(boxed_message.private_slot.detach())
    assert boxed_message.required == message.required


def test_batches_beyond_a_full_slot_pool_leave_nothing_behind():
    loader = FastLoader(TensorDataset(n=40), batch_size=4, num_workers=2, persistent_workers=True,
                        ring_slots=1)
    list(loader)
    before = snapshot()
    held = list(loader) + list(loader)  # all but one of them outside the slot pool
    assert_same(held, list(DataLoader(TensorDataset(n=40), batch_size=4)) * 2)
    assert slot_pool_of(loader).occupancy[1] == 1
    del held
    assert_no_leaks(before)


def test_workers_map_no_memory_but_the_slot_pools():
    # A worker's private slot is the main process's once handed over: the worker must not
    # keep it mapped (the memory of a batch outside the slot pool would outlive the batch).
    loader = FastLoader(TensorDataset(n=40), batch_size=4, num_workers=2, persistent_workers=True,
                        ring_slots=1)
    for _ in range(2):
        for _batch in loader:
            pass
    del _batch
    gc.collect()
    # The pool of persistent workers keeps no descriptor for its slots: what this process maps
    # is the pool (no batch outside it is alive).
    ring_inodes = memfd_inodes("self", "/memfd:fastfeed")
    assert len(ring_inodes) == len(slot_pool_of(loader)._slots)
    for worker in loader._live_iterator()._table:
        mapped = memfd_inodes(worker.handle.pid, "/memfd:fastfeed")
        assert mapped <= ring_inodes, (mapped, ring_inodes)


def memfd_inodes(pid, prefix):
    with open(f"/proc/{pid}/maps") as maps:
        return {int(line.split()[4]) for line in maps if prefix in line}


def numpy_collate(samples):
    """Numpy leaves only, of several kinds: plain, structured, and a view of another leaf."""
    x = np.stack([s[0].numpy() for s in samples])
    records = np.zeros(len(samples), dtype=[("label", "i8"), ("score", "f4")])
    records["label"] = [int(s[1]) for s in samples]
    return {"x": x, "records": records, "first_row": x[0]}


def test_numpy_leaves_alone_keep_their_slot():
    # The user keeps only numpy leaves (numpy collapses the chain of views, so a leaf must
    # hold the slot's lease through an object numpy does not skip).
    def run(cls):
        kept = []
        loader = cls(TensorDataset(n=48), batch_size=4, num_workers=2, collate_fn=numpy_collate)
        for _ in range(2):
            for batch in loader:
                kept.append(batch["x"])
                del batch
                gc.collect()
        return kept

    assert_same(run(FastLoader), run(DataLoader))


def tensor_and_array_collate(samples):
    labels = [int(s[1]) for s in samples]
    return {"img": torch.stack([s[0] for s in samples]), "labels": np.array(labels)}


def test_a_numpy_leaf_outlives_its_batch_moving_to_shared_memory():
    # share_memory_() (or a torch.multiprocessing queue) moves a tensor leaf's memory, and
    # whatever that memory held: a numpy leaf of the same batch must keep its slot by itself.
    loader = FastLoader(TensorDataset(n=64), batch_size=4, num_workers=2,
                        collate_fn=tensor_and_array_collate, persistent_workers=True, ring_slots=2)
    list(loader)
    iterator = iter(loader)
    batch = next(iterator)
    labels, expected = batch["labels"], batch["labels"].copy()
    batch["img"].share_memory_()
    del batch
    gc.collect()
    for _ in iterator:
        pass
    assert np.array_equal(labels, expected), (labels, expected)


def layout_collate(samples):
    array = np.stack([s[0].numpy() for s in samples])
    tensor = torch.stack([s[0] for s in samples])
    return {"array": array, "array_again": array, "tensor": tensor, "tensor_again": tensor,
            "fortran": np.asfortranarray(array.reshape(len(samples), -1)),
            "big_endian": array.astype(">i4"), "empty": np.zeros((0, 4))}


def layout(batch):
    """What pickling keeps beyond values: identity, strides, byte order."""
    return (batch["array"] is batch["array_again"], batch["tensor"] is batch["tensor_again"],
            batch["fortran"].strides, batch["big_endian"].dtype.str, batch["empty"].strides)


def test_leaves_keep_identity_layout_and_byte_order_as_torch_gives_them():
    def run(cls):
        loader = cls(TensorDataset(n=16), batch_size=4, num_workers=2, collate_fn=layout_collate,
                     persistent_workers=True)
        return [batch for _ in range(2) for batch in loader]  # private slots, then the slot pool's

    expected, got = run(DataLoader), run(FastLoader)
    assert_same(expected, got)
    assert [layout(b) for b in got] == [layout(b) for b in expected]
    got[0]["array"][0, 0, 0, 0] = 255  # one object, so one memory
    assert got[0]["array_again"][0, 0, 0, 0] == 255


def storage_sizes(batch):
    return [leaf.untyped_storage().nbytes() for leaf in batch]


def views_collate(samples):
    images = torch.stack([s[0] for s in samples])
    return [images, images[1:], torch.tensor([s[1] for s in samples])]


def test_each_leaf_has_a_storage_of_its_own_size():
    # Not the whole slot: torch.save(labels) writes the labels, a queue moves only them.
    def run(cls, **kwargs):
        loader = cls(TensorDataset(n=16), batch_size=4, num_workers=2, persistent_workers=True,
                     **kwargs)
        return [batch for _ in range(2) for batch in loader]

    for kwargs in ({}, {"collate_fn": views_collate}):
        expected, got = run(DataLoader, **kwargs), run(FastLoader, **kwargs)
        assert_same(expected, got)
        assert [storage_sizes(b) for b in got] == [storage_sizes(b) for b in expected]
    images, rest, _ = got[-1]
    assert rest.untyped_storage().data_ptr() == images.untyped_storage().data_ptr()
    images[1].zero_()  # views of one storage in the worker are views of one storage here
    assert rest[0].eq(0).all()


def test_rows_of_a_big_tensor_do_not_copy_the_tensor():
    big = torch.arange(1 << 20, dtype=torch.float32).view(-1, 64)  # 4 MiB; a row is 256 bytes
    dataset = torch.utils.data.TensorDataset(big)
    every_256th = list(range(0, len(dataset), 256))
    loader = FastLoader(dataset, batch_size=None, sampler=every_256th, num_workers=2,
                        persistent_workers=True)
    got = [row for _ in range(2) for (row,) in loader]
    assert slot_pool_of(loader).slot_bytes < big.nbytes // 4
    assert_same(got, [dataset[i][0] for _ in range(2) for i in every_256th])


def test_structured_arrays_keep_their_fields():
    compare(lambda: TensorDataset(n=24), batch_size=4, num_workers=2, collate_fn=numpy_collate,
            epochs=2, persistent_workers=True)


def prefix_collate(samples):
    # Two storages that start at one address: a view of the start of an array, and the array.
    array = np.stack([s[0].numpy() for s in samples])
    return [torch.from_numpy(array[:1]), torch.from_numpy(array)]


def test_storages_that_share_an_address_are_copied_whole():
    compare(lambda: TensorDataset(n=24), batch_size=4, num_workers=2, collate_fn=prefix_collate,
            epochs=2, persistent_workers=True)


@MODES
@pytest.mark.parametrize("ring_slots", [1, 3, None])
def test_hoarded_batches_never_change(ring_slots, worker_mode):
    # The user keeps every batch of two epochs; later batches must not overwrite any of them.
    loader = FastLoader(TensorDataset(n=60), batch_size=4, num_workers=2, shuffle=True,
                        persistent_workers=True, ring_slots=ring_slots, worker_mode=worker_mode)
    kept, copies = [], []
    for _ in range(2):
        for batch in loader:
            kept.append(batch)
            copies.append(clone(batch))
    assert_same(kept, copies)
    _, allocated = slot_pool_of(loader).occupancy
    assert allocated <= (ring_slots if ring_slots is not None else 2 * 2 + 2)


@MODES
def test_a_held_view_keeps_its_slot(worker_mode):
    loader = FastLoader(TensorDataset(n=80), batch_size=4, num_workers=2, persistent_workers=True,
                        ring_slots=3, worker_mode=worker_mode)
    list(loader)
    iterator = iter(loader)
    view = next(iterator)[0][1, :, 2:5]  # the batch itself is dropped; only a view survives
    expected = view.clone()
    for _ in iterator:
        pass
    assert torch.equal(view, expected)


@MODES
def test_slots_return_when_batches_die(worker_mode):
    loader = FastLoader(TensorDataset(n=80), batch_size=4, num_workers=2, persistent_workers=True,
                        worker_mode=worker_mode)
    list(loader)
    held = list(loader)
    used_while_held, _ = slot_pool_of(loader).occupancy
    assert used_while_held > 0
    del held
    gc.collect()
    assert slot_pool_of(loader).occupancy[0] == 0


def test_custom_collate_tensors_and_arrays_go_to_the_slot():
    loader = FastLoader(DetectionDataset(n=40), batch_size=4, num_workers=2,
                        collate_fn=detection_collate, persistent_workers=True)
    list(loader)
    batch = next(iter(loader))
    for key in ("img", "bboxes", "numpy"):
        assert in_a_slot(loader, batch[key]), f"{key} was not rebuilt from the slot"


@MODES
def test_slot_aware_collate_slots_hold_one_batch(worker_mode):
    # The first batches, sent before the slot pool knows their size, teach it: an image written by a
    # slot-aware collate outside a slot is counted once, not again when the codec copies it.
    loader = FastLoader(TensorDataset(n=32, shape=(3, 32, 32), dtype=torch.uint8), batch_size=8,
                        num_workers=2, collate_fn=ImageCollate(), persistent_workers=True,
                        worker_mode=worker_mode)
    list(loader)
    batch_bytes = 8 * 3 * 32 * 32 + 8 * 8  # images, int64 targets
    assert batch_bytes <= slot_pool_of(loader).slot_bytes < 2 * batch_bytes


class GrowingDataset(Dataset):
    """Later samples are much larger than the first ones: batches outgrow their slots."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        size = 4 if i < 16 else 64
        return torch.full((size, size), i, dtype=torch.int32)


def growing_collate(samples):
    return [s.clone() for s in samples]


def test_variable_sizes_overflow_then_grow():
    compare(GrowingDataset, batch_size=4, num_workers=2, collate_fn=growing_collate, epochs=2,
            persistent_workers=True)
    loader = FastLoader(GrowingDataset(), batch_size=4, num_workers=2,
                        collate_fn=growing_collate, persistent_workers=True)
    list(loader)
    # The slot size follows the largest batch seen (with headroom).
    assert slot_pool_of(loader).slot_bytes >= 4 * 64 * 64 * 4


def test_slot_pool_is_bounded_across_epochs():
    loader = FastLoader(TensorDataset(n=40), batch_size=4, num_workers=2, persistent_workers=True)
    sizes = []
    for _ in range(5):
        list(loader)
        sizes.append(slot_pool_of(loader).nbytes)
    assert sizes[1:] == sizes[1:2] * 4
    assert sizes[-1] <= slot_pool_of(loader).max_slots * slot_pool_of(loader).slot_bytes


def test_one_slot_pool_serves_non_persistent_epochs():
    loader = FastLoader(TensorDataset(n=40), batch_size=4, num_workers=2)
    list(loader)
    slot_pool = slot_pool_of(loader)
    assert slot_pool.slot_bytes > 0 and slot_pool.occupancy[1] > 0
    list(loader)
    assert slot_pool_of(loader) is slot_pool


def test_slot_pool_refuses_slots_larger_than_memory(monkeypatch):
    import fastfeed.slots.pool as pool_module

    monkeypatch.setattr(pool_module, "available_memory", lambda: 1 << 16)
    with pytest.warns(RuntimeWarning, match="does not fit"):
        compare(lambda: TensorDataset(n=24, shape=(3, 64, 64)), batch_size=8, num_workers=2,
                epochs=2, persistent_workers=True)


def test_pickled_slot_pool_is_empty():
    import pickle

    slot_pool = SlotPool(4, slot_bytes=8192)
    slot_pool.acquire()
    clone_ = pickle.loads(pickle.dumps(slot_pool))
    assert clone_.nbytes == 0 and clone_.slot_bytes == 8192 and clone_.max_slots == 4


@MODES
def test_mutating_a_batch_does_not_affect_the_next(worker_mode):
    # torch hands out fresh memory every batch; a user who writes into a batch must not see it
    # come back in a later batch from a reused slot.
    def run(cls, **kwargs):
        out = []
        for batch in cls(TensorDataset(n=40), batch_size=4, num_workers=2, **kwargs):
            out.append(batch[0].clone())
            batch[0].zero_()
        return out

    assert_same(run(DataLoader), run(FastLoader, worker_mode=worker_mode))


def batch_and_first_row(samples):
    x = torch.stack([s[0] for s in samples])
    return x, x[0]


def first_row_and_batch(samples):
    x = torch.stack([s[0] for s in samples])
    return x[0], x


@pytest.mark.parametrize("collate_fn", [batch_and_first_row, first_row_and_batch])
def test_a_view_of_a_leaf_stays_a_view_of_it(collate_fn):
    # A row is an eighth of the batch: copied alone, it would no longer see the batch change.
    def run(cls):
        rows = []
        loader = cls(TensorDataset(n=32), batch_size=8, num_workers=2, collate_fn=collate_fn)
        for batch in loader:
            x, row = batch if collate_fn is batch_and_first_row else batch[::-1]
            x.add_(1)
            rows.append(row.clone())
        return rows

    assert_same(run(FastLoader), run(DataLoader))


def test_the_control_pipe_hands_each_slot_over_with_its_descriptor():
    """A SlotAdded arrives as one message that carries the receiver's own descriptor for the
    slot (for the same memory); a closed end is an EOFError, a gone reader an OSError."""
    from fastfeed.protocol import SlotAdded, SlotDropped
    from fastfeed.slots.control import ControlPipe
    from fastfeed.slots.memory import new_memfd

    main, worker = ControlPipe.pair()
    fd = new_memfd("fastfeed-test", 4096)
    try:
        main.send(SlotDropped(3))
        main.send(SlotAdded(7, 4096, fd))
        assert worker.receive() == SlotDropped(3)
        assert worker.poll()
        added = worker.receive()
        assert (added.slot_id, added.nbytes) == (7, 4096) and added.fd != fd
        assert os.fstat(added.fd).st_ino == os.fstat(fd).st_ino
        os.close(added.fd)
        assert not worker.poll()
        main.close()
        with pytest.raises(EOFError):
            worker.receive()
    finally:
        os.close(fd)
        worker.close()
    main, worker = ControlPipe.pair()
    worker.close()
    with pytest.raises(OSError):
        main.send(SlotDropped(1))
    main.close()
