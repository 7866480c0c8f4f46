"""Lightning's Trainer with FastLoader, side by side with the stock loader: a DataModule on
the CPU, ``ddp_spawn`` with 2 ranks (loader built in a hook, and passed straight to ``fit``,
so pickled to the ranks and rebuilt with a DistributedSampler), Lightning's rebuild from a
loader's attributes, and ``copy.deepcopy``/``pickle`` round trips."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch
from helpers import assert_same, run_epochs
from sample_datasets import TensorDataset
from torch.utils.data import DataLoader, DistributedSampler

from fastfeed import FastLoader

pytestmark = [pytest.mark.clients, pytest.mark.timeout(240)]
L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.utilities.data import _update_dataloader  # noqa: E402

SAMPLES = 24


class Recorder(L.LightningModule):
    """Records the batches its training step sees, one file per rank."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.out = out
        self.seen: list = []

    def training_step(self, batch, index):
        images, labels = batch
        self.seen.append((images.clone(), labels.clone()))
        return self.layer(images.float().mean((1, 2, 3)).unsqueeze(1)).sum()

    def on_train_end(self) -> None:
        torch.save(self.seen, self.out / f"rank{self.global_rank}.pt")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Data(L.LightningDataModule):
    """Builds its loader in the ``train_dataloader`` hook."""

    def __init__(self, cls: type[DataLoader], workers: int) -> None:
        super().__init__()
        self.cls, self.workers = cls, workers

    def train_dataloader(self) -> DataLoader:
        return build(self.cls, self.workers)


def build(cls: type[DataLoader], workers: int, persistent: bool = True) -> DataLoader:
    return cls(TensorDataset(SAMPLES), batch_size=4, shuffle=True, num_workers=workers,
               persistent_workers=persistent and workers > 0)


def fit(out: Path, ranks: int, data: Data | None = None,
        loader: DataLoader | None = None) -> list:
    """Train 2 epochs; the batches each rank saw, by rank."""
    out.mkdir()
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=ranks, strategy="ddp_spawn" if ranks > 1 else "auto",
        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(out))
    trainer.fit(Recorder(out), datamodule=data, train_dataloaders=loader)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(ranks)]


@pytest.mark.parametrize("workers", [0, 2])
def test_fit_with_a_datamodule(tmp_path, workers):
    expected = fit(tmp_path / "stock", 1, data=Data(DataLoader, workers))
    assert_same(fit(tmp_path / "fast", 1, data=Data(FastLoader, workers)), expected)


@pytest.fixture(scope="module")
def stock_ddp_spawn(tmp_path_factory: pytest.TempPathFactory) -> list:
    """The stock loader under ``ddp_spawn``: the same batches whether built in a hook or
    passed to ``fit`` (Lightning adds the same DistributedSampler), so computed once."""
    return fit(tmp_path_factory.mktemp("lightning") / "stock", 2, data=Data(DataLoader, 1))


def test_ddp_spawn_loader_built_in_a_hook(tmp_path, stock_ddp_spawn):
    assert_same(fit(tmp_path / "fast", 2, data=Data(FastLoader, 1)), stock_ddp_spawn)


def test_ddp_spawn_loader_passed_to_fit(tmp_path, stock_ddp_spawn):
    """The loader is pickled to the ranks, then rebuilt there with a DistributedSampler."""
    assert_same(fit(tmp_path / "fast", 2, loader=build(FastLoader, 1)), stock_ddp_spawn)


@pytest.mark.parametrize("workers", [0, 2])
def test_rebuild_from_attributes(workers):
    """Lightning's ``_update_dataloader`` (reads ``vars(loader)`` and the constructor's
    signature) on a loader built outside a hook, with a DistributedSampler swapped in."""
    def rebuilt(cls: type[DataLoader], rank: int) -> list:
        loader = build(cls, workers)
        sampler = DistributedSampler(loader.dataset, num_replicas=2, rank=rank, seed=3)
        loader = _update_dataloader(loader, sampler)
        assert type(loader) is cls and loader.num_workers == workers
        return run_epochs(loader, 2, seed=0)

    for rank in range(2):
        assert_same(rebuilt(FastLoader, rank), rebuilt(DataLoader, rank))


@pytest.mark.parametrize("round_trip", [copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))],
                         ids=["deepcopy", "pickle"])
@pytest.mark.parametrize("workers", [0, 2])
def test_copies_of_a_loader(round_trip, workers):
    """A copy, taken before and after an epoch, gives the stock loader's batches (not
    persistent: torch's persistent iterator cannot be copied, in either loader)."""
    expected = run_epochs(build(DataLoader, workers, persistent=False), 2, seed=0)
    fast = build(FastLoader, workers, persistent=False)
    assert_same(run_epochs(round_trip(fast), 2, seed=0), expected)
    run_epochs(fast, 1, seed=0)
    assert_same(run_epochs(round_trip(fast), 2, seed=0), expected)
