"""Datasets that hold large lists, for the shared-lists tests; module-level so that spawn can
pickle them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


def folder_samples(n: int, classes: int = 7, start: int = 0) -> list[tuple[str, int]]:
    """``(path, class)`` pairs as torchvision's ``ImageFolder.samples`` holds them."""
    return [(f"/data/train/c{i % classes}/img_{i}.JPEG", i % classes)
            for i in range(start, start + n)]


class FolderIndex(Dataset):
    """``ImageFolder``'s bookkeeping without images: ``samples``, ``imgs`` (the same list) and
    ``targets``; an item is its path, its class, a number parsed from the path and a random
    draw (so that the workers' seeding is compared too)."""

    def __init__(self, n: int = 600) -> None:
        self.samples = folder_samples(n)
        self.imgs = self.samples
        self.targets = [target for _, target in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        number = int(path.rsplit("_", 1)[1].split(".")[0])
        return path, torch.tensor([number, self.targets[index]]), torch.rand(()), target


class KindProbe(FolderIndex):
    """Items say what the worker reads ``samples`` as: the shared copy or the list itself."""

    def __getitem__(self, index: int):
        return type(self.samples).__name__, self.imgs is self.samples


@dataclass(frozen=True)
class Record:
    path: str
    target: int


class RecordIndex(FolderIndex):
    """Samples that are objects, not plain values: left as they are."""

    def __init__(self, n: int = 600) -> None:
        super().__init__(n)
        self.samples = [Record(path, target) for path, target in self.samples]

    def __getitem__(self, index: int):
        record = self.samples[index]
        return record.path, record.target, type(self.samples).__name__


class PathStream(IterableDataset):
    """An IterableDataset whose replicas read their share of a list of paths."""

    def __init__(self, n: int = 600) -> None:
        self.paths = [path for path, _ in folder_samples(n)]

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, len(self.paths), step):
            yield self.paths[i], torch.rand(())


def reverse_in_place(worker_id: int) -> None:
    """A ``worker_init_fn`` that changes the dataset's list in place."""
    get_worker_info().dataset.samples.reverse()


def reassign_reversed(worker_id: int) -> None:
    """A ``worker_init_fn`` that gives the dataset a new list."""
    dataset = get_worker_info().dataset
    dataset.samples = dataset.samples[::-1]


def record_kind(path: Path, worker_id: int) -> None:
    """A ``worker_init_fn`` (with ``functools.partial``) that writes what the worker reads
    ``samples`` as into ``path``."""
    samples = get_worker_info().dataset.samples
    path.with_name(f"{path.name}.{worker_id}").write_text(type(samples).__name__)


class Tally(Dataset):
    """A dataset that counts, in each worker, how often it read each item (as a cache that
    Ultralytics' datasets fill in their workers)."""

    def __init__(self) -> None:
        self.seen = [0] * 300 + list(range(1000, 1300))

    def __len__(self) -> int:
        return len(self.seen)

    def __getitem__(self, index: int):
        self.seen[index] += 1
        return index, self.seen[index]
