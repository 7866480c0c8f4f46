"""``InfiniteFastLoader`` without Ultralytics: one iterator for every epoch, reset, close.

Parity with Ultralytics' own ``InfiniteDataLoader`` is in ``test_ultralytics.py`` (client
environment); here the same contract is checked against torch's DataLoader.
"""

import pytest
import torch
from helpers import assert_same
from procs import assert_no_leaks, snapshot
from sample_datasets import RandomAugmentDataset
from torch.utils.data import DataLoader

from fastfeed.ultralytics import InfiniteFastLoader


def epochs(loader_class, count, **kwargs):
    torch.manual_seed(0)
    loader = loader_class(RandomAugmentDataset(), batch_size=3, shuffle=True,
                          generator=torch.Generator().manual_seed(1), **kwargs)
    return loader, [list(loader) for _ in range(count)]


def test_epochs_are_the_sampler_repeated():
    """Each epoch is the next pass of the shuffled sampler, served by the first iterator."""
    loader, got = epochs(InfiniteFastLoader, 3, num_workers=2)
    first = loader.iterator
    assert len(loader) == 8 and [len(e) for e in got] == [8, 8, 8]
    # torch, with persistent workers, also keeps one base seed and reshuffles every epoch
    _, expected = epochs(DataLoader, 3, num_workers=2, persistent_workers=True)
    assert_same(got, expected)
    assert loader.iterator is first
    loader.close()


def test_reset_restarts_workers_and_close_frees_them():
    before = snapshot()
    loader = epochs(InfiniteFastLoader, 1, num_workers=2)[0]
    first = loader.iterator
    pids = {w.handle.pid for w in first._table}
    loader.reset()
    assert loader.iterator is None
    list(loader)
    assert {w.handle.pid for w in loader.iterator._table}.isdisjoint(pids)
    loader.close()
    del first, loader
    assert_no_leaks(before)


def test_needs_a_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        InfiniteFastLoader(RandomAugmentDataset(), batch_size=None)


def test_patch_needs_ultralytics():
    try:
        import ultralytics  # noqa: F401
    except Exception:
        import fastfeed.ultralytics as fu

        with pytest.raises(ImportError):
            fu.patch()
        assert not fu.is_patched()
    else:
        pytest.skip("ultralytics is installed: test_ultralytics.py covers the patch")
