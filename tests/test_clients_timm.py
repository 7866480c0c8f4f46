"""timm datasets and transforms through FastLoader, and timm's own ``create_loader`` under
:func:`fastfeed.integrations.timm.patch`, side by side with the stock loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from clients import labelled_jpegs
from helpers import assert_same, compare, run_epochs

import fastfeed.integrations.timm as fastfeed_timm
from fastfeed import FastLoader

pytestmark = [pytest.mark.clients, pytest.mark.timeout(120)]
timm_data = pytest.importorskip("timm.data")
from timm.data.loader import PrefetchLoader  # noqa: E402

LOADERS = [
    pytest.param({"num_workers": 0}, id="0-workers"),
    pytest.param({"num_workers": 2}, id="2-workers"),
    pytest.param({"num_workers": 2, "persistent_workers": True}, id="2-workers-persistent"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("timm")
    for i, (image, label) in enumerate(labelled_jpegs(24, classes=3)):
        (root / f"class_{label}").mkdir(exist_ok=True)
        (root / f"class_{label}" / f"{i:03d}.jpg").write_bytes(image)
    return root


def training_dataset(folder: Path):
    dataset = timm_data.create_dataset("", root=str(folder), is_training=True)
    dataset.transform = timm_data.create_transform(32, is_training=True)
    return dataset


@pytest.mark.parametrize("options", LOADERS)
def test_create_dataset_and_training_transform(folder, options):
    assert compare(lambda: training_dataset(folder), epochs=2, batch_size=5, shuffle=True,
                   **options) == 2 * 5


def test_evaluation_transform_with_drop_last(folder):
    def dataset():
        return timm_data.create_dataset("", root=str(folder),
                                        transform=timm_data.create_transform(32))

    assert compare(dataset, epochs=2, batch_size=5, drop_last=True, num_workers=2) == 2 * 4


def create_loader(folder: Path, **options):
    """timm's ``create_loader`` as its ``train.py`` calls it; on the CPU, its ``PrefetchLoader``
    needs ``device="cpu"`` (its default, ``cuda``, builds the mean on the GPU)."""
    return timm_data.create_loader(
        timm_data.create_dataset("", root=str(folder), is_training=True), input_size=(3, 32, 32),
        batch_size=5, is_training=True, device=torch.device("cpu"), **options)


def base_loader(loader):
    return getattr(loader, "loader", loader)  # under PrefetchLoader


@pytest.mark.parametrize("options", [
    pytest.param({"num_workers": 2, "use_prefetcher": True}, id="prefetcher"),
    pytest.param({"num_workers": 0, "use_prefetcher": False}, id="0-workers-no-prefetcher"),
    pytest.param({"num_workers": 2, "use_prefetcher": False, "persistent_workers": True},
                 id="persistent"),
    pytest.param({"num_workers": 2, "use_prefetcher": True, "use_multi_epochs_loader": True},
                 id="multi-epochs-loader"),
])
def test_create_loader_patched(folder, options):
    expected_loader = create_loader(folder, **options)
    assert not isinstance(base_loader(expected_loader), FastLoader)
    with fastfeed_timm.patched():
        actual_loader = create_loader(folder, **options)
    assert isinstance(base_loader(actual_loader), FastLoader)
    if options["use_prefetcher"]:  # timm's PrefetchLoader stays on top
        assert type(actual_loader) is type(expected_loader) is PrefetchLoader
    assert_same(run_epochs(actual_loader, 2, seed=0), run_epochs(expected_loader, 2, seed=0))


def test_patch_is_reversible_and_takes_fastloader_options(folder):
    fastfeed_timm.patch(worker_mode="thread", ring_slots=3)
    try:
        assert fastfeed_timm.is_patched()
        loader = base_loader(create_loader(folder, num_workers=2))
        assert isinstance(loader, FastLoader)
        assert (loader.worker_mode, loader.ring_slots) == ("thread", 3)
    finally:
        fastfeed_timm.unpatch()
    assert not fastfeed_timm.is_patched()
    assert type(base_loader(create_loader(folder, num_workers=2))) is torch.utils.data.DataLoader
    with pytest.raises(TypeError, match="not FastLoader options"):
        fastfeed_timm.patch(batch_size=3)
