"""torchvision's ``ImageFolder``, ``fastfeed.vision.accelerate``'s copy of it and Hugging Face
Accelerate's ``prepare()``: the workers read ``samples`` and ``imgs`` (one object) from the
shared copy, and the batches are the stock loader's. (The ``targets`` of three classes are
small ints, which reading never copies: left as they are.)"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from helpers import assert_same, run_epochs
from torch.utils.data import DataLoader, get_worker_info

from fastfeed import FastLoader
from fastfeed.shared_lists import finder
from fastfeed.vision.synthetic import make_imagefolder

pytestmark = pytest.mark.clients
try:
    from torchvision import datasets
    from torchvision import transforms as T
except Exception as error:  # missing, or built for another torch (a RuntimeError)
    pytest.skip(f"needs torchvision: {error}", allow_module_level=True)

from fastfeed.vision.accelerate import accelerate  # noqa: E402

TRAIN = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.ToTensor()])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("folder"), images=24, classes=3)


@pytest.fixture(autouse=True)
def small_lists(monkeypatch):
    """Share lists of 8 elements or more: the folder holds 24 images."""
    monkeypatch.setattr(finder, "MIN_LENGTH", 8)


def record_lists(probe: Path, worker_id: int) -> None:
    """A ``worker_init_fn``: what the worker reads the folder's lists as."""
    dataset = get_worker_info().dataset
    probe.with_name(f"{probe.name}.{worker_id}").write_text(
        f"{type(dataset.samples).__name__},{dataset.imgs is dataset.samples},"
        f"{type(dataset.targets).__name__}")


def read_probes(probe: Path) -> set[str]:
    return {p.read_text() for p in probe.parent.glob(f"{probe.name}.*")}


def folder(root: Path, accelerated: bool) -> datasets.ImageFolder:
    dataset = datasets.ImageFolder(str(root), transform=TRAIN)
    return accelerate(dataset) if accelerated else dataset


@pytest.mark.parametrize("accelerated", [False, True], ids=["imagefolder", "accelerate"])
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_folder_lists_are_shared(root, tmp_path, accelerated, context):
    def epochs(cls, probe=None):
        loader = cls(folder(root, accelerated), batch_size=5, shuffle=True, num_workers=2,
                     multiprocessing_context=context,
                     worker_init_fn=None if probe is None else functools.partial(record_lists,
                                                                                 probe))
        return run_epochs(loader, 2, seed=0)

    probe = tmp_path / "kinds"
    assert_same(epochs(FastLoader, probe), epochs(DataLoader))
    assert read_probes(probe) == {"SharedList,True,list"}


def test_hf_accelerate_prepared_loader_reads_shared_lists(root, tmp_path):
    accelerate_lib = pytest.importorskip("accelerate")
    import fastfeed.integrations.hf_accelerate as fastfeed_accelerate

    def prepared(cls, probe=None):
        loader = cls(datasets.ImageFolder(str(root), transform=TRAIN), batch_size=5,
                     shuffle=True, num_workers=2,
                     worker_init_fn=None if probe is None else functools.partial(record_lists,
                                                                                 probe))
        return accelerate_lib.Accelerator(cpu=True).prepare(loader)

    probe = tmp_path / "kinds"
    expected = run_epochs(prepared(DataLoader), 2, seed=0)
    with fastfeed_accelerate.patched():
        loader = prepared(FastLoader, probe)
    assert isinstance(loader.base_dataloader, FastLoader)
    assert_same(run_epochs(loader, 2, seed=0), expected)
    assert read_probes(probe) == {"SharedList,True,list"}
