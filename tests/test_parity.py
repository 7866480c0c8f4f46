"""Differential tests: FastLoader against torch's DataLoader, side by side, batch by batch."""

import re
import warnings

import pytest
import torch
from helpers import assert_same, compare
from sample_datasets import (
    DetectionDataset,
    GetItemsDataset,
    InitTagDataset,
    MixedDataset,
    ShardedIterable,
    TensorDataset,
    UnevenIterable,
    UnshardedIterable,
    detection_collate,
    record_worker_init,
)
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

from fastfeed import FastLoader

WORKERS = [0, 1, 2]


@pytest.mark.parametrize("num_workers", WORKERS)
@pytest.mark.parametrize("batch_size", [1, 4, None])
@pytest.mark.parametrize("shuffle", [False, True])
def test_map_style(num_workers, batch_size, shuffle):
    assert compare(
        MixedDataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        generator=7,
    )


@pytest.mark.parametrize("num_workers", WORKERS)
def test_global_rng_without_generator(num_workers):
    # No generator: base seed and shuffle seed come from torch's global RNG, in torch's order.
    compare(MixedDataset, batch_size=3, shuffle=True, num_workers=num_workers, seed=123)


@pytest.mark.parametrize("num_workers", WORKERS)
@pytest.mark.parametrize("drop_last", [False, True])
def test_tensor_batches_and_drop_last(num_workers, drop_last):
    compare(TensorDataset, batch_size=5, num_workers=num_workers, drop_last=drop_last)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.bfloat16, torch.int64,
                                   torch.bool, torch.complex64])
def test_dtypes_through_the_slot_pool(dtype):
    compare(lambda: TensorDataset(shape=(2, 5), dtype=dtype), batch_size=4, num_workers=2)


@pytest.mark.parametrize("num_workers", WORKERS)
def test_custom_samplers(num_workers):
    def sampler():
        return RandomSampler(range(37), replacement=True, num_samples=20,
                             generator=torch.Generator().manual_seed(3))

    compare(TensorDataset, sampler=sampler, batch_size=3, num_workers=num_workers)
    batches = BatchSampler(SequentialSampler(range(37)), batch_size=6, drop_last=False)
    compare(TensorDataset, batch_sampler=batches, num_workers=num_workers)
    compare(TensorDataset, batch_sampler=[[3, 1], [0], [5, 5, 5]], num_workers=num_workers)


@pytest.mark.parametrize("num_workers", WORKERS)
def test_getitems(num_workers):
    compare(GetItemsDataset, batch_size=4, num_workers=num_workers)


@pytest.mark.parametrize("num_workers", WORKERS)
def test_custom_collate_variable_boxes(num_workers):
    compare(DetectionDataset, batch_size=4, num_workers=num_workers,
            collate_fn=detection_collate, shuffle=True, generator=1)


@pytest.mark.parametrize("num_workers", WORKERS)
@pytest.mark.parametrize("batch_size", [4, None])
def test_iterable_sharded(num_workers, batch_size):
    compare(ShardedIterable, batch_size=batch_size, num_workers=num_workers)


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_iterable_uneven_round_robin(num_workers):
    compare(UnevenIterable, batch_size=None, num_workers=num_workers)
    compare(UnevenIterable, batch_size=2, num_workers=num_workers, drop_last=True)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_length_warning_matches(num_workers):
    messages = []
    for cls in (DataLoader, FastLoader):
        loader = cls(UnevenIterable(), batch_size=None, num_workers=num_workers)
        assert len(loader) == 4
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            list(loader)
        messages.append([re.sub(r" at 0x[0-9a-f]+", "", str(w.message))
                         for w in caught if "Length of" in str(w.message)])
    assert messages[0] == messages[1]
    assert bool(messages[0]) == (num_workers > 0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_unsharded_duplicates(num_workers):
    compare(UnshardedIterable, batch_size=2, num_workers=num_workers)


@pytest.mark.parametrize("dataset", [MixedDataset, ShardedIterable, UnevenIterable])
def test_persistent_workers_across_epochs(dataset):
    compare(dataset, batch_size=3, num_workers=2, persistent_workers=True, epochs=3,
            **({"shuffle": True, "generator": 5} if dataset is MixedDataset else {}))


def test_persistent_workers_reuse_processes():
    loader = FastLoader(TensorDataset(), batch_size=4, num_workers=2, persistent_workers=True)
    list(loader)
    pids = [w.handle.pid for w in loader._iterator._table]
    list(loader)
    assert [w.handle.pid for w in loader._iterator._table] == pids


def test_persistent_workers_after_break():
    # A new epoch after an abandoned one starts from the beginning, as in torch.
    def build(cls):
        return cls(TensorDataset(), batch_size=4, num_workers=2, persistent_workers=True,
                   shuffle=True, generator=torch.Generator().manual_seed(9))

    runs = []
    for cls in (DataLoader, FastLoader):
        loader = build(cls)
        first = [b for _, b in zip(range(2), loader, strict=False)]
        runs.append((first, list(loader), list(loader)))
    assert_same(runs[0], runs[1])


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_multiprocessing_contexts(context):
    compare(MixedDataset, batch_size=6, num_workers=2, multiprocessing_context=context,
            shuffle=True, generator=2)


def test_worker_init_fn_runs_in_each_worker():
    compare(InitTagDataset, batch_size=2, num_workers=2, worker_init_fn=record_worker_init)


def test_in_order_false_delivers_every_batch():
    expected = [b for b in DataLoader(TensorDataset(), batch_size=3, num_workers=2)]
    got = list(FastLoader(TensorDataset(), batch_size=3, num_workers=2, in_order=False))
    key = lambda batch: batch[1][0].item()  # noqa: E731
    assert_same(sorted(expected, key=key), sorted(got, key=key))


@pytest.mark.parametrize("device", [None, "cpu"])
def test_in_order_false_with_a_device_delivers_every_batch(device):
    # The device stage notes where the epoch stands after each batch; that must not demand a
    # snapshot, which in_order=False cannot give mid-epoch.
    expected = [b for b in DataLoader(TensorDataset(), batch_size=3, num_workers=2)]
    loader = FastLoader(TensorDataset(), batch_size=3, num_workers=2, in_order=False,
                        device=device)
    got = list(loader)
    key = lambda batch: batch[1][0].item()  # noqa: E731
    assert_same(sorted(expected, key=key), sorted(got, key=key))
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(RuntimeError, match="in_order=True"):
        loader.state_dict()  # asked for, it still says why it cannot


class DrawsInIter(torch.utils.data.Sampler):
    """A batch sampler that draws its batches when iterated (bucketing samplers, torchvision's
    GroupedBatchSampler pattern), and counts its epochs there."""

    def __init__(self):
        self.epochs = 0

    def __len__(self):
        return 2

    def __iter__(self):
        self.epochs += 1
        order = torch.randperm(8).tolist()
        return iter([order[:4], order[4:]])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_sampler_drawing_in_iter_is_iterated_as_torch_does(num_workers):
    runs = {}
    for cls in (DataLoader, FastLoader):
        sampler = DrawsInIter()
        torch.manual_seed(0)
        batches = [b.tolist() for _ in range(2)
                   for b in cls(list(range(8)), batch_sampler=sampler, num_workers=num_workers)]
        runs[cls] = (batches, sampler.epochs, torch.rand(2))
    (want, want_epochs, want_rng), (got, got_epochs, got_rng) = runs.values()
    assert got == want and got_epochs == want_epochs
    assert torch.equal(got_rng, want_rng)  # the global RNG was drawn from as often


@pytest.mark.parametrize("ring_slots", [0, 1, None])
def test_slot_pool_size_does_not_change_results(ring_slots):
    fast = {"ring_slots": ring_slots}
    compare(DetectionDataset, batch_size=3, num_workers=2, collate_fn=detection_collate, fast=fast)
    compare(MixedDataset, batch_size=4, num_workers=2, fast=fast, epochs=2)


def test_prefetch_factor_and_len():
    for kwargs in ({"batch_size": 4}, {"batch_size": 4, "drop_last": True}, {"batch_size": None}):
        a = DataLoader(TensorDataset(), num_workers=2, prefetch_factor=1, **kwargs)
        b = FastLoader(TensorDataset(), num_workers=2, prefetch_factor=1, **kwargs)
        assert len(a) == len(b)
        assert_same(list(a), list(b))


class Pair(list):
    """A sample that is a list subclass."""


class PairDataset(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return Pair([i, i + 1])

    def __getitems__(self, indices):
        return Pair(self[i] for i in indices)  # a batch's samples, in a list subclass too


def keep_samples(samples):
    return samples


@pytest.mark.parametrize("num_workers", [0, 2])
def test_list_subclasses_keep_their_type(num_workers):
    # Neither one sample (batch_size=None) nor a __getitems__ result is rebuilt as a list.
    compare(PairDataset, batch_size=None, num_workers=num_workers)
    compare(PairDataset, batch_size=2, num_workers=num_workers, collate_fn=keep_samples)
