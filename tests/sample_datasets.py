"""Datasets for the differential tests; module-level so that spawn can pickle them."""

from __future__ import annotations

import math
import os
import random
import time
from collections import namedtuple

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

Point = namedtuple("Point", ["x", "y"])


class TensorDataset(Dataset):
    """Fixed-size uint8 images and int labels: the slot pool's fast path."""

    def __init__(self, n: int = 37, shape: tuple[int, ...] = (3, 8, 8), dtype=torch.uint8):
        self.n, self.shape, self.dtype = n, shape, dtype

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        image = (torch.rand(self.shape, generator=g) * 200).to(self.dtype)
        return image, i


class MixedDataset(Dataset):
    """Every leaf type default_collate handles, plus worker RNG draws to check seeding."""

    def __init__(self, n: int = 23):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = get_worker_info()
        return {
            "image": torch.full((2, 3), i, dtype=torch.float32),
            "array": np.arange(4, dtype=np.int16) + i,
            "scalar": np.float64(i) / 3,
            "label": i,
            "weight": i / 7,
            "name": f"sample-{i}",
            "raw": b"bytes",
            "point": Point(torch.tensor(i), [i, i + 1]),
            "nested": {"list": [torch.ones(1) * i, (i, "x")]},
            "torch_rng": torch.rand(1),
            "py_rng": random.random(),
            "np_rng": np.random.rand(),
            "worker": -1 if info is None else info.id,
            "seed": -1 if info is None else info.seed,
        }


class GetItemsDataset(TensorDataset):
    """Batched fetching through ``__getitems__``."""

    def __getitems__(self, indices):
        return [(self[i][0] + 1, -i) for i in indices]


class DetectionDataset(Dataset):
    """YOLO-style samples: a fixed-size image and a variable number of boxes."""

    def __init__(self, n: int = 19):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        boxes = torch.rand(i % 4, 4, generator=g)
        return {"img": torch.full((3, 16, 16), i % 255, dtype=torch.uint8), "bboxes": boxes,
                "cls": torch.full((i % 4, 1), float(i % 3))}


def detection_collate(samples):
    """Ultralytics-style: stack images, concatenate boxes and tag them with batch_idx."""
    return {
        "img": torch.stack([s["img"] for s in samples]),
        "bboxes": torch.cat([s["bboxes"] for s in samples]),
        "cls": torch.cat([s["cls"] for s in samples]),
        "batch_idx": torch.cat(
            [torch.full((len(s["bboxes"]),), float(j)) for j, s in enumerate(samples)]
        ),
        "im_files": [f"{j}.jpg" for j in range(len(samples))],
        "numpy": np.arange(len(samples)),
    }


class ShardedIterable(IterableDataset):
    """Splits range(start, end) across workers, like torch's documentation example."""

    def __init__(self, start: int = 0, end: int = 29):
        self.start, self.end = start, end

    def __iter__(self):
        info = get_worker_info()
        if info is None:
            lo, hi = self.start, self.end
        else:
            per = math.ceil((self.end - self.start) / info.num_workers)
            lo = self.start + info.id * per
            hi = min(lo + per, self.end)
        for i in range(lo, hi):
            yield torch.tensor([i, torch.randint(0, 1000, ()).item()])


class UnevenIterable(IterableDataset):
    """Worker k yields 3k+1 items: replicas end at different times."""

    def __iter__(self):
        info = get_worker_info()
        wid = 0 if info is None else info.id
        for j in range(3 * wid + 1):
            yield {"worker": wid, "j": j}

    def __len__(self) -> int:
        return 4


class UnshardedIterable(IterableDataset):
    """Every replica yields the same items (torch duplicates them; so must we)."""

    def __iter__(self):
        yield from (torch.tensor(i) for i in range(5))


class FailingDataset(Dataset):
    """Raises a KeyError for one index."""

    def __init__(self, bad: int = 5, n: int = 12):
        self.bad, self.n = bad, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.bad:
            raise KeyError(f"bad index {i}")
        return torch.tensor(i)


class SlowDataset(Dataset):
    """Sleeps per sample, so that a test can act while workers are busy."""

    def __init__(self, n: int = 1000, delay: float = 0.05):
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.delay)
        return torch.tensor(i)


class BusyAfterFirst(Dataset):
    """Index 0 returns at once, every other index sleeps ``delay`` s: after the first batch,
    the workers are busy in ``__getitem__``."""

    def __init__(self, n: int = 100, delay: float = 30.0):
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i:
            time.sleep(self.delay)
        return torch.tensor(i)


class SuicideDataset(Dataset):
    """The worker that loads index ``kill_at`` kills itself with ``signum``."""

    def __init__(self, kill_at: int = 6, signum: int = 9, n: int = 40):
        self.kill_at, self.signum, self.n = kill_at, signum, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.kill_at:
            if self.signum == 0:
                os._exit(3)
            os.kill(os.getpid(), self.signum)
            time.sleep(10)
        return torch.tensor(i)


def record_worker_init(worker_id: int) -> None:
    """A worker_init_fn whose effect shows in the batches."""
    info = get_worker_info()
    assert info is not None and info.id == worker_id
    info.dataset.init_tag = 1000 + worker_id


class InitTagDataset(Dataset):
    def __init__(self):
        self.init_tag = -1

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        return torch.tensor([i, self.init_tag])


def failing_worker_init(worker_id: int) -> None:
    raise ValueError(f"init failed in worker {worker_id}")


def failing_collate(samples):
    raise TypeError("collate refuses")


class StatefulIterable(IterableDataset):
    """Sharded counter that can report and restore its position."""

    def __init__(self, n: int = 41):
        self.n = n
        self.position = 0

    def _my_items(self):
        info = get_worker_info()
        wid, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return list(range(wid, self.n + wid * 3, workers))  # uneven replicas

    def __iter__(self):
        items = self._my_items()
        while self.position < len(items):
            value = items[self.position]
            self.position += 1
            yield torch.tensor([value, value * value])
        self.position = 0  # the next epoch starts over

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class RandomAugmentDataset(Dataset):
    """Deterministic content plus draws from all three global RNGs (an 'augmentation')."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        return torch.tensor([float(i), torch.rand(()).item(), random.random(),
                             float(np.random.rand())])


def thread_identity(_i=None):
    from fastfeed import worker_info

    info = worker_info()
    return None if info is None else (info.id, info.worker_method)


class ThreadInfoDataset(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        from fastfeed import worker_info

        info = worker_info()
        return {"i": i, "id": -1 if info is None else info.id,
                "method": "none" if info is None else str(info.worker_method)}
