"""fastfeed.tail_split: which split a dataset offers, and where its tail runs (no integration
needed: a stand-in transform offers the split)."""

import warnings

import pytest
import torch
from torch.utils.data import Dataset

from fastfeed._torch_compat import default_collate
from fastfeed.tail_split import BatchTailSplit, batch_tail_split, plan_tail


def tail(batch):
    return batch.float() / 255


def tail_into(batch, empty):
    return tail(batch)


def split_of(gpu_only=False):
    """Short items whose tail makes float images: everywhere, or (``gpu_only``) on a device."""
    return BatchTailSplit(dataset=Short(), tail=tail,
                          collate=None if gpu_only else _SlotCollate(),
                          tail_into=None if gpu_only else tail_into,
                          device_collate=default_collate, needs_device="needs a device")


class _SlotCollate:
    def __call__(self, samples):
        return tail(default_collate(samples))

    def collate_into(self, samples, empty):
        return self(samples)


class Offers:
    """A transform that offers a split of the dataset it is in."""

    def __init__(self, gpu_only=False):
        self.gpu_only = gpu_only

    def __call__(self, image):
        return image

    def split_batch_tail(self, dataset):
        return split_of(self.gpu_only)


class Short(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.full((2,), i, dtype=torch.uint8)


class Offering(Short):
    def __init__(self, gpu_only=False):
        self.transform = Offers(gpu_only)


def test_the_split_applies_only_with_automatic_batching_and_torchs_collate():
    dataset = Offering()
    assert isinstance(batch_tail_split(dataset, default_collate, True), BatchTailSplit)
    assert batch_tail_split(dataset, lambda samples: samples, True) is None
    assert batch_tail_split(dataset, default_collate, False) is None
    assert batch_tail_split(Short(), default_collate, True) is None  # no transform offers one


def test_a_device_only_split_that_cannot_apply_says_so():
    with pytest.warns(UserWarning, match="a collate_fn of its own"):
        assert batch_tail_split(Offering(gpu_only=True), lambda s: s, True) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch_tail_split(Offering(), lambda s: s, True)  # made whole in the workers: silent


def test_on_a_device_the_tail_runs_there_and_the_workers_collate_short_items():
    split = batch_tail_split(Offering(), default_collate, True)
    planned = plan_tail(split, on_device=True, lands_batches=True)
    assert planned.dataset is split.dataset and planned.device_tail is tail
    assert planned.collate_fn is default_collate and planned.landing_tail is None


def test_without_a_device_the_tail_runs_on_landing_where_batches_land():
    split = batch_tail_split(Offering(), default_collate, True)
    planned = plan_tail(split, on_device=False, lands_batches=True)
    assert planned.landing_tail is tail_into and planned.device_tail is None
    assert planned.collate_fn is None  # the workers collate with the loader's own


def test_else_the_workers_collate_the_finished_batch_into_the_slot():
    split = batch_tail_split(Offering(), default_collate, True)
    planned = plan_tail(split, on_device=False, lands_batches=False)
    assert planned.collate_fn is split.collate
    assert planned.device_tail is None and planned.landing_tail is None


def test_a_device_only_tail_without_a_device_is_an_error():
    split = batch_tail_split(Offering(gpu_only=True), default_collate, True)
    with pytest.raises(ValueError, match="needs a device"):
        plan_tail(split, on_device=False, lands_batches=False)


def test_no_split_plans_nothing():
    planned = plan_tail(None, on_device=True, lands_batches=True)
    assert (planned.dataset, planned.collate_fn, planned.device_tail,
            planned.landing_tail) == (None, None, None, None)
