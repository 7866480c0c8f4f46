"""Streaming datasets (litdata, mosaicml-streaming) through FastLoader and the stock loader.

Each library writes a small dataset into ``tmp_path`` with its own writer (litdata's
``optimize``, streaming's ``MDSWriter``) and reads it back locally. Both loaders run two
epochs side by side; a FastLoader resumed mid-epoch from its ``state_dict`` must yield the
stock loader's remaining batches. Both libraries' ``state_dict`` belongs to their own
loaders (it takes arguments): FastLoader must not call it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from clients import array_sample
from helpers import assert_same, compare, run_epochs
from torch.utils.data import DataLoader

from fastfeed import FastLoader

pytestmark = [pytest.mark.clients, pytest.mark.timeout(180)]

SAMPLES = 48
LOADERS = [
    pytest.param({"num_workers": 0}, id="0-workers"),
    pytest.param({"num_workers": 2}, id="2-workers"),
    pytest.param({"num_workers": 2, "persistent_workers": True}, id="2-workers-persistent"),
]


def resume_matches_stock(make_dataset, workers: int, delivered: int = 3, **options) -> None:
    """FastLoader, stopped after ``delivered`` batches and resumed in a new loader from its
    state, yields what the stock loader yields after its first ``delivered`` batches, and then
    the same next epoch."""
    def build(cls: type[DataLoader]) -> DataLoader:
        return cls(make_dataset(), batch_size=4, num_workers=workers, **options)

    expected = run_epochs(build(DataLoader), 2, seed=0)
    first = build(FastLoader)
    torch.manual_seed(0)
    iterator = iter(first)
    for _ in range(delivered):
        next(iterator)
    state = first.state_dict()
    del iterator
    resumed = build(FastLoader)
    resumed.load_state_dict(state)
    assert_same(list(resumed), expected[0][delivered:], "resumed epoch")
    assert_same(list(resumed), expected[1], "next epoch")


# ---------------------------------------------------------------- litdata
@pytest.fixture(scope="module")
def litdata_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``optimize`` runs in a child process: it leaves multiprocessing queue threads behind,
    and worker processes forked after that take seconds to exit, with either loader."""
    pytest.importorskip("litdata")
    output = tmp_path_factory.mktemp("litdata") / "optimized"
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
              "import litdata; from clients import array_sample; "
              f"litdata.optimize(fn=array_sample, inputs=list(range({SAMPLES})), "
              f"output_dir={str(output)!r}, chunk_size=8, num_workers=1, mode='overwrite')")
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
    return str(output)


def litdata_dataset(directory: str, **options: Any):
    import litdata
    return litdata.StreamingDataset(input_dir=directory, **options)


@pytest.mark.parametrize("options", LOADERS)
def test_litdata_streaming_dataset(litdata_dir, options):
    assert compare(lambda: litdata_dataset(litdata_dir), epochs=2, batch_size=4,
                   **options) > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_litdata_resume(litdata_dir, workers):
    resume_matches_stock(lambda: litdata_dataset(litdata_dir), workers)


def fast_streaming_loader_class() -> type:
    """litdata's ``StreamingDataLoader`` over FastLoader: FastLoader after it in the MRO,
    and FastLoader's iterators in place of the torch ones it builds itself."""
    from litdata import StreamingDataLoader

    class FastStreamingDataLoader(StreamingDataLoader, FastLoader):
        _get_iterator = FastLoader._get_iterator

    return FastStreamingDataLoader


@pytest.mark.parametrize("options", LOADERS)
def test_litdata_streaming_dataloader_on_fastloader(litdata_dir, options):
    """Its epochs (``set_epoch`` on the dataset, its shuffle) as with its stock base."""
    from litdata import StreamingDataLoader

    def run(cls: type) -> list:
        dataset = litdata_dataset(litdata_dir, shuffle=True, seed=7)
        return run_epochs(cls(dataset, batch_size=4, **options), 2, seed=0)

    fast = fast_streaming_loader_class()
    assert_same(run(fast), run(StreamingDataLoader))


def test_litdata_streaming_dataloader_state_dict(litdata_dir):
    """Its own ``state_dict`` (which calls the dataset's with arguments) works over FastLoader,
    and resumes to the stock loader's remaining batches (no workers: litdata restarts a worker
    pool on the worker after the last one, which FastLoader's pool does not know)."""
    from litdata import StreamingDataLoader

    fast = fast_streaming_loader_class()

    def build(cls: type):
        return cls(litdata_dataset(litdata_dir), batch_size=4, num_workers=0)

    expected = list(build(StreamingDataLoader))
    first = build(fast)
    iterator = iter(first)
    for _ in range(3):
        next(iterator)
    state = first.state_dict()
    del iterator
    resumed = build(fast)
    resumed.load_state_dict(state)
    assert_same(list(resumed), expected[3:])


# ---------------------------------------------------------------- mosaicml-streaming
@pytest.fixture(scope="module")
def mds_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    streaming = pytest.importorskip("streaming")
    output = tmp_path_factory.mktemp("mds") / "mds"
    with streaming.MDSWriter(out=str(output), columns={"x": "ndarray:uint8", "label": "int"},
                             size_limit=1 << 11) as writer:
        for i in range(SAMPLES):
            writer.write(array_sample(i))
    return str(output)


def mosaic_dataset(directory: str, **options: Any):
    import streaming
    streaming.base.util.clean_stale_shared_memory()
    return streaming.StreamingDataset(local=directory, batch_size=4, **options)


@pytest.mark.parametrize("options", LOADERS)
def test_mosaic_streaming_dataset(mds_dir, options):
    assert compare(lambda: mosaic_dataset(mds_dir), epochs=2, batch_size=4, **options) > 0


def test_mosaic_streaming_dataset_shuffled(mds_dir):
    def dataset():
        return mosaic_dataset(mds_dir, shuffle=True, shuffle_seed=3)

    assert compare(dataset, epochs=2, batch_size=4, num_workers=2) > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_mosaic_resume(mds_dir, workers):
    resume_matches_stock(lambda: mosaic_dataset(mds_dir), workers)


def test_generated_samples_differ():
    """The samples are not all alike (else equal batches would prove nothing)."""
    assert len({array_sample(i)["x"].tobytes() for i in range(SAMPLES)}) == SAMPLES
