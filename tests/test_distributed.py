"""A 2-rank job on CPU (gloo): DistributedSampler shards, parity with torch, set_epoch."""

import json

import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import assert_same
from sample_datasets import TensorDataset
from torch.utils.data import DataLoader, DistributedSampler

from fastfeed import FastLoader

WORLD = 2


def _rank(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        dataset = TensorDataset(n=40)
        loaders = {
            cls.__name__: cls(dataset, batch_size=4, num_workers=2,
                              sampler=DistributedSampler(dataset, shuffle=True, seed=5))
            for cls in (DataLoader, FastLoader)
        }
        epochs = []
        for epoch in range(2):
            batches = {}
            for name, loader in loaders.items():
                loader.sampler.set_epoch(epoch)
                batches[name] = list(loader)
            assert_same(batches["DataLoader"], batches["FastLoader"])
            epochs.append([label for _, labels in batches["FastLoader"]
                           for label in labels.tolist()])
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, epochs)
        if rank == 0:
            with open(f"{out_dir}/labels.json", "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_shard_disjointly_and_match_torch(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    per_rank = json.loads((tmp_path / "labels.json").read_text())
    for epoch in range(2):
        shards = [set(per_rank[r][epoch]) for r in range(WORLD)]
        assert not shards[0] & shards[1], "ranks overlap"
        assert shards[0] | shards[1] == set(range(40)), "ranks do not cover the dataset"
    assert per_rank[0][0] != per_rank[0][1], "set_epoch did not reshuffle"
