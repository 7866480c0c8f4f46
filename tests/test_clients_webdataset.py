"""webdataset pipelines through FastLoader and the stock DataLoader, side by side.

Tar shards of tiny JPEGs are written into ``tmp_path``; every pipeline runs two epochs in both
loaders with the same arguments and seeds, and the batches must be equal.
"""

from __future__ import annotations

import pytest
import torch
from clients import labelled_jpegs
from helpers import assert_same, compare, run_epochs
from torch.utils.data import DataLoader

from fastfeed import FastLoader

pytestmark = [pytest.mark.clients, pytest.mark.timeout(120)]
wds = pytest.importorskip("webdataset")

SHARDS, PER_SHARD = 4, 10
LOADERS = [
    pytest.param({"num_workers": 0}, id="0-workers"),
    pytest.param({"num_workers": 2}, id="2-workers"),
    pytest.param({"num_workers": 2, "persistent_workers": True}, id="2-workers-persistent"),
]


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("shards")
    samples = labelled_jpegs(SHARDS * PER_SHARD)
    paths = []
    for shard in range(SHARDS):
        path = root / f"shard-{shard:02d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(shard * PER_SHARD, (shard + 1) * PER_SHARD):
                image, label = samples[i]
                sink.write({"__key__": f"{i:05d}", "jpg": image, "cls": label})
        paths.append(str(path))
    return paths


def scaled(image: torch.Tensor) -> torch.Tensor:
    return image * 2 - 1


def decoded(urls: list[str]):
    return (wds.WebDataset(urls, shardshuffle=False, empty_check=False)
            .decode("torchrgb").to_tuple("jpg", "cls").map_tuple(scaled, int))


def batched(urls: list[str]):
    return decoded(urls).batched(4)


def shuffled(urls: list[str]):
    """A seeded sample shuffle (unseeded, webdataset seeds it from the pid and the clock)."""
    return (wds.WebDataset(urls, shardshuffle=False, empty_check=False).shuffle(8, seed=3)
            .decode("pil").to_tuple("jpg", "cls").map_tuple(lambda im: im.size, int))


@pytest.mark.parametrize("options", LOADERS)
def test_decode_to_tuple_map_tuple(urls, options):
    assert compare(lambda: decoded(urls), epochs=2, batch_size=4, **options) == 2 * 10


@pytest.mark.parametrize("options", LOADERS)
def test_batched_with_batch_size_none(urls, options):
    assert compare(lambda: batched(urls), epochs=2, batch_size=None, **options) == 2 * 10


def test_sample_shuffle(urls):
    assert compare(lambda: shuffled(urls), epochs=2, batch_size=4, num_workers=2) == 2 * 10


def test_fluid_wrapper_over_the_loader(urls):
    """``FluidWrapper`` re-batches whatever loader it wraps, in the main process."""
    def rebatched(cls: type[DataLoader]):
        loader = cls(decoded(urls), batch_size=4, num_workers=2)
        return wds.FluidWrapper(loader).unbatched().batched(6)

    expected = run_epochs(rebatched(DataLoader), 2, seed=0)
    actual = run_epochs(rebatched(FastLoader), 2, seed=0)
    assert_same(actual, expected)
