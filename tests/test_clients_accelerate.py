"""Hugging Face Accelerate's ``prepare()`` with FastLoader, under
:func:`fastfeed.integrations.hf_accelerate.patch`, side by side with the stock loader."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same, run_epochs
from sample_datasets import TensorDataset
from torch.utils.data import DataLoader

import fastfeed.integrations.hf_accelerate as fastfeed_accelerate
from fastfeed import FastLoader

pytestmark = [pytest.mark.clients, pytest.mark.timeout(120)]
accelerate = pytest.importorskip("accelerate")


def prepare(loader: DataLoader):
    return accelerate.Accelerator(cpu=True).prepare(loader)


def build(cls: type[DataLoader], workers: int, **options) -> DataLoader:
    return cls(TensorDataset(40), batch_size=4, shuffle=True, num_workers=workers, **options)


def test_unpatched_prepare_replaces_fastloader():
    """What :func:`patch` is for: Accelerate rebuilds the loader over a stock DataLoader."""
    assert not fastfeed_accelerate.is_patched()
    prepared = prepare(build(FastLoader, 2))
    assert type(prepared.base_dataloader) is DataLoader


@pytest.mark.parametrize("workers", [0, 2])
def test_prepare_keeps_fastloader(workers):
    expected = run_epochs(prepare(build(DataLoader, workers)), 2, seed=0)
    with fastfeed_accelerate.patched():
        prepared = prepare(build(FastLoader, workers, worker_mode="thread"))
    assert isinstance(prepared.base_dataloader, FastLoader)
    assert prepared.base_dataloader.worker_mode == "thread"  # its own options, kept
    assert_same(run_epochs(prepared, 2, seed=0), expected)


def test_stock_loaders_get_the_patch_options():
    """A loader built by someone else (the ``Trainer``) becomes a FastLoader too."""
    expected = run_epochs(prepare(build(DataLoader, 2)), 2, seed=0)
    with fastfeed_accelerate.patched(ring_slots=3):
        prepared = prepare(build(DataLoader, 2))
    assert isinstance(prepared.base_dataloader, FastLoader)
    assert prepared.base_dataloader.ring_slots == 3
    assert_same(run_epochs(prepared, 2, seed=0), expected)


def test_skip_first_batches():
    def skipped(cls: type[DataLoader]) -> list:
        accelerator = accelerate.Accelerator(cpu=True)
        loader = accelerator.skip_first_batches(accelerator.prepare(build(cls, 2)), 3)
        assert isinstance(loader.base_dataloader, cls)
        return run_epochs(loader, 1, seed=0)

    expected = skipped(DataLoader)
    with fastfeed_accelerate.patched():
        assert_same(skipped(FastLoader), expected)


def test_patch_is_reversible():
    fastfeed_accelerate.patch()
    fastfeed_accelerate.patch(worker_mode="thread")  # replaces the options only
    fastfeed_accelerate.unpatch()
    assert not fastfeed_accelerate.is_patched()
    assert accelerate.data_loader.DataLoader is DataLoader
    assert type(prepare(build(FastLoader, 0)).base_dataloader) is DataLoader
    with pytest.raises(TypeError, match="not FastLoader options"):
        fastfeed_accelerate.patch(shuffle=True)
    assert torch.utils.data.DataLoader is DataLoader
