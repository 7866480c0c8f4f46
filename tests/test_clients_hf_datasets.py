"""Hugging Face ``datasets`` through FastLoader and the stock DataLoader, side by side.

Datasets are built in memory from tiny generated JPEGs (no hub access): map-style with
``with_format("torch")``, iterable from ``to_iterable_dataset``, split by node, and with
fewer shards than workers (one worker's replica yields nothing), also with slow samples.
"""

from __future__ import annotations

import time

import pytest
from clients import labelled_jpegs
from helpers import assert_same, compare, run_epochs
from torch.utils.data import DataLoader

from fastfeed import FastLoader

pytestmark = [pytest.mark.clients, pytest.mark.timeout(120)]
datasets = pytest.importorskip("datasets")
from datasets.distributed import split_dataset_by_node  # noqa: E402

LOADERS = [
    pytest.param({"num_workers": 0}, id="0-workers"),
    pytest.param({"num_workers": 2}, id="2-workers"),
    pytest.param({"num_workers": 2, "persistent_workers": True}, id="2-workers-persistent"),
]


def images(count: int = 32):
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    samples = labelled_jpegs(count)
    return datasets.Dataset.from_dict(
        {"image": [{"bytes": image, "path": None} for image, _ in samples],
         "label": [label for _, label in samples]}, features=features)


def torch_format():
    return images().with_format("torch")


def iterable(num_shards: int):
    return images().to_iterable_dataset(num_shards=num_shards).with_format("torch")


def slowly(sample: dict) -> dict:
    time.sleep(0.01)
    return sample


@pytest.mark.parametrize("options", LOADERS)
def test_map_style_torch_format(options):
    assert compare(torch_format, epochs=2, batch_size=5, shuffle=True, generator=1,
                   **options) == 2 * 7


@pytest.mark.parametrize("workers", [0, 2])
def test_map_style_resume(workers):
    """FastLoader's state after 3 batches gives, in a new loader, stock's remaining batches."""
    def build(cls):
        import torch
        return cls(torch_format(), batch_size=5, shuffle=True, num_workers=workers,
                   generator=torch.Generator().manual_seed(1))

    expected = list(build(DataLoader))
    first = build(FastLoader)
    iterator = iter(first)
    for _ in range(3):
        next(iterator)
    state = first.state_dict()
    del iterator
    resumed = build(FastLoader)
    resumed.load_state_dict(state)
    assert_same(list(resumed), expected[3:])


@pytest.mark.parametrize("options", LOADERS)
def test_to_iterable_dataset(options):
    # With 2 workers, each reads 2 of the 4 shards (16 samples): batches of 5, 5, 5 and 1.
    batches = 8 if options["num_workers"] else 7
    assert compare(lambda: iterable(4), epochs=2, batch_size=5, **options) == 2 * batches


@pytest.mark.parametrize("rank", [0, 1])
def test_split_dataset_by_node(rank):
    def dataset():
        return split_dataset_by_node(iterable(4), rank=rank, world_size=2)

    assert compare(dataset, epochs=2, batch_size=4, num_workers=2) == 2 * 4


@pytest.mark.parametrize("persistent", [False, True], ids=["", "persistent"])
def test_fewer_shards_than_workers(persistent):
    """One shard for two workers: worker 1's replica ends at once, every epoch."""
    def dataset():
        return iterable(1).shuffle(seed=0, buffer_size=8)

    assert compare(dataset, epochs=3, batch_size=4, num_workers=2,
                   persistent_workers=persistent) == 3 * 8


def test_fewer_shards_than_workers_slow_samples():
    """The same, 10 ms per sample: worker 1 is done long before worker 0."""
    def dataset():
        return iterable(1).shuffle(seed=0, buffer_size=8).map(slowly)

    assert compare(dataset, epochs=2, batch_size=4, num_workers=2) == 2 * 8


def test_fluid_with_set_epoch():
    """``set_epoch`` between epochs reshuffles the same way in both loaders."""
    def run(cls):
        dataset = iterable(4).shuffle(seed=0, buffer_size=8)
        loader = cls(dataset, batch_size=4, num_workers=2)
        epochs = []
        for epoch in range(2):
            dataset.set_epoch(epoch)
            epochs.append(run_epochs(loader, 1, seed=0)[0])
        return epochs

    assert_same(run(FastLoader), run(DataLoader))
