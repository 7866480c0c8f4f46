"""fastfeed.shared_lists.cache: a loader packs its dataset's lists once, and packs them again
as soon as they differ in any way a worker could see."""

import contextlib
import gc
import os

import pytest
import torch
from list_datasets import FolderIndex, folder_samples
from torch.utils.data import DataLoader

from fastfeed import FastLoader
from fastfeed.shared_lists import ListsCache, finder


@pytest.fixture(autouse=True)
def small_lists(monkeypatch):
    monkeypatch.setattr(finder, "MIN_LENGTH", 100)


def test_unchanged_lists_are_packed_once():
    dataset, cache = FolderIndex(), ListsCache()
    first = cache.snapshot(dataset, keep_fd=True)
    assert first.packed is not None
    assert cache.snapshot(dataset, keep_fd=True) is first
    assert cache.snapshot(dataset, keep_fd=False) is first  # a fork needs no descriptor


def replace_one(d):
    d.samples[5] = ("/data/elsewhere/img_99999.JPEG", 3)


def append_one(d):
    d.targets.append(1)


def reassign(d):
    d.samples = list(d.samples)  # equal, but another list: its owners are read again


def alias(d):
    d.paths = d.imgs  # a new attribute holding a packed list


def equal_element(d):
    d.samples[0] = tuple(list(d.samples[0]))  # an equal pair, another object: still the same


@pytest.mark.parametrize("change", [replace_one, append_one, reassign, alias])
def test_a_change_a_worker_could_see_packs_again(change):
    dataset, cache = FolderIndex(), ListsCache()
    first = cache.snapshot(dataset, keep_fd=True)
    change(dataset)
    again = cache.snapshot(dataset, keep_fd=True)
    assert again is not first
    assert cache.snapshot(dataset, keep_fd=True) is again


def test_an_equal_element_is_no_change():
    dataset, cache = FolderIndex(), ListsCache()
    first = cache.snapshot(dataset, keep_fd=True)
    equal_element(dataset)
    assert cache.snapshot(dataset, keep_fd=True) is first


def test_another_dataset_or_a_missing_descriptor_packs_again():
    cache = ListsCache()
    forked = cache.snapshot(FolderIndex(), keep_fd=False)
    dataset = FolderIndex()
    assert cache.snapshot(dataset, keep_fd=False) is not forked
    without_fd = cache.snapshot(dataset, keep_fd=False)
    assert cache.snapshot(dataset, keep_fd=True) is not without_fd  # spawn needs one


@pytest.mark.parametrize("context", ["fork", "forkserver", "spawn"])
@pytest.mark.parametrize("change", [replace_one, append_one, reassign, equal_element])
def test_each_epoch_reads_the_lists_as_they_are_then(context, change):
    # Without persistent workers, each epoch's workers read the dataset as it is when they
    # start: as torch's, whose workers get it pickled (or forked) every epoch.
    def epochs(cls):
        torch.manual_seed(0)
        dataset = FolderIndex(300)
        loader = cls(dataset, batch_size=100, shuffle=True, num_workers=2,
                     multiprocessing_context=context)
        seen = []
        for _ in range(3):
            seen.append([(batch[0], batch[1].tolist(), batch[3].tolist()) for batch in loader])
            change(dataset)
        return seen

    assert epochs(FastLoader) == epochs(DataLoader)


def test_the_descriptor_goes_with_the_loader():
    def packed_lists_fds():
        named = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile
                named += ["fastfeed-lists" in os.readlink(f"/proc/self/fd/{fd}")]
        return sum(named)

    gc.collect()
    before = packed_lists_fds()  # others' loaders, in this process, not yet collected
    loader = FastLoader(FolderIndex(), batch_size=100, num_workers=2,
                        multiprocessing_context="forkserver")
    for _ in range(2):
        list(loader)
    assert packed_lists_fds() == before + 1  # kept between epochs, for the next one's workers
    del loader
    gc.collect()
    assert packed_lists_fds() == before


def test_samples_beyond_the_packed_length_are_not_read_stale():
    dataset = FolderIndex(200)
    cache = ListsCache()
    first = cache.snapshot(dataset, keep_fd=True)
    dataset.samples.extend(folder_samples(100, start=200))
    assert cache.snapshot(dataset, keep_fd=True) is not first
