"""A plain torch IterableDataset whose worker replicas yield uneven counts, side by side.

No client library needed: these are the shapes that Hugging Face's and the streaming
libraries' datasets take when they have fewer shards than workers (one replica yields
nothing) or unevenly sized ones, reduced to torch alone.
"""

from __future__ import annotations

import time

import pytest
import torch
from helpers import compare
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from fastfeed import FastLoader

pytestmark = [pytest.mark.clients, pytest.mark.timeout(120)]


class Uneven(IterableDataset):
    """Worker ``i`` yields ``counts[i]`` samples (``counts[0]`` in the main process)."""

    def __init__(self, counts: tuple[int, ...], seconds_per_sample: float = 0.0) -> None:
        self.counts = counts
        self.seconds_per_sample = seconds_per_sample

    def __iter__(self):
        info = get_worker_info()
        worker = 0 if info is None else info.id
        for i in range(self.counts[worker]):
            time.sleep(self.seconds_per_sample)
            yield torch.tensor([worker, i])


@pytest.mark.parametrize("counts", [(40, 0), (0, 40), (8, 40), (40, 8)], ids=str)
@pytest.mark.parametrize("persistent", [False, True], ids=["", "persistent"])
def test_uneven_replicas(counts, persistent):
    compare(lambda: Uneven(counts), epochs=3, batch_size=4, num_workers=2,
            persistent_workers=persistent)


@pytest.mark.parametrize("counts", [(8, 40), (40, 0)], ids=str)
def test_uneven_replicas_slow_samples(counts):
    """With 2 ms per sample, the short replica ends while the other still has tasks queued."""
    compare(lambda: Uneven(counts, seconds_per_sample=0.002), epochs=2, batch_size=4,
            num_workers=2)


def test_uneven_replicas_out_of_order():
    """``in_order=False``: the same batches, in whichever order workers deliver them."""
    def run(cls):
        loader = cls(Uneven((8, 40)), batch_size=4, num_workers=2, in_order=False)
        return [sorted(map(tuple, torch.cat(list(loader)).tolist())) for _ in range(2)]

    assert run(FastLoader) == run(DataLoader)
