"""fastfeed.produce: the produce step every kind of worker runs (an index in, a batch out)."""

import random

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from fastfeed import SKIP
from fastfeed._torch_compat import default_collate
from fastfeed.produce import Producer, sample_seed
from fastfeed.protocol import WorkerConfig


class Noisy(Dataset):
    """Each sample draws from the global generators, as augmentations do."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([i, random.randrange(10**6)])


class SkipsOdd(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return SKIP if i % 2 else torch.tensor(i)


class Counting(IterableDataset):
    """Yields 0..n-1 and says where it is, with torchdata's snapshot protocol."""

    def __init__(self, n=5):
        self.n, self.position = n, 0

    def __iter__(self):
        while self.position < self.n:
            self.position += 1
            yield self.position - 1

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def config(dataset, *, iterable=False, deterministic=False, base_seed=7):
    return WorkerConfig(dataset=dataset, iterable=iterable, auto_collation=True,
                        collate_fn=default_collate, drop_last=False, base_seed=base_seed,
                        worker_init_fn=None, worker_id=0, num_workers=1,
                        deterministic=deterministic)


def test_an_index_batch_becomes_the_collated_batch_without_a_slot_pool():
    producer = Producer(config(SkipsOdd()))
    producer.start_epoch()
    produced = producer.produce([0, 2, 4])
    assert torch.equal(produced.batch, torch.tensor([0, 2, 4]))
    assert produced.fetch_s >= 0 and produced.collate_s >= 0 and produced.skipped == 0


def test_skipped_samples_are_dropped_and_counted():
    producer = Producer(config(SkipsOdd()))
    producer.start_epoch()
    produced = producer.produce([0, 1, 2, 3])
    assert torch.equal(produced.batch, torch.tensor([0, 2])) and produced.skipped == 2


def test_deterministic_samples_do_not_depend_on_which_batch_reads_them():
    producer = Producer(config(Noisy(), deterministic=True))
    producer.start_epoch(epoch=3)
    alone = producer.produce([5]).batch[0]
    random.seed(0)  # whatever the generators' state before
    among = producer.produce([1, 5, 2]).batch[1]
    assert torch.equal(alone, among)
    producer.start_epoch(epoch=4)
    assert not torch.equal(alone, producer.produce([5]).batch[0])  # another epoch, other draws


def test_in_the_main_process_reseeding_leaves_the_global_generators_as_they_were():
    producer = Producer(config(Noisy(), deterministic=True), in_main_process=True)
    producer.start_epoch()
    random.seed(1)
    expected = random.random()
    random.seed(1)
    producer.produce([0, 1])
    assert random.random() == expected


def test_sample_seeds_differ_by_epoch_and_index_and_are_stable():
    seeds = {sample_seed(7, epoch, index) for epoch in range(3) for index in range(50)}
    assert len(seeds) == 150
    assert sample_seed(7, 1, (2, "a")) == sample_seed(7, 1, (2, "a"))


def test_an_iterable_replica_reports_its_state_and_resumes_from_one():
    producer = Producer(config(Counting(), iterable=True))
    producer.start_epoch()
    first = producer.produce([None])
    assert first.batch.tolist() == [0] and first.dataset_state == {"position": 1}
    again = Producer(config(Counting(), iterable=True))
    again.start_epoch(0, dataset_state={"position": 3})
    assert again.produce([None]).batch.tolist() == [3]


def test_an_exhausted_replica_raises_stop_iteration():
    producer = Producer(config(Counting(n=1), iterable=True))
    producer.start_epoch()
    producer.produce([None])
    with pytest.raises(StopIteration):
        producer.produce([None])
