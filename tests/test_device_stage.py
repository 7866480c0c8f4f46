"""fastfeed.device.stage: the device stage assembled from an epoch's StagePlan (the CPU path;
the CUDA one is in test_device_streams.py and test_gpu_rules.py)."""

import torch
from sample_datasets import TensorDataset

from fastfeed import FastLoader
from fastfeed.device import CpuCopier, DeviceIterator, DeviceStage, StagePlan, chain
from fastfeed.telemetry import Telemetry


class Part:
    def __init__(self, name, log, blocks_host=False):
        self.name, self.log, self.blocks_host = name, log, blocks_host

    def __call__(self, batch):
        self.log.append(self.name)
        return [*batch, self.name]

    def prepare(self, device):
        self.log.append(f"prepare {self.name} on {device}")


def test_chain_runs_the_tail_then_the_users_transform():
    log = []
    tail, user = Part("tail", log), Part("user", log)
    assert chain(tail, user)([]) == ["tail", "user"]
    assert chain(None, user) is user and chain(tail, None) is tail and chain(None, None) is None


def test_a_chain_blocks_the_host_when_a_part_does_and_prepares_each_part():
    log = []
    chained = chain(Part("tail", log, blocks_host=True), Part("user", log))
    assert chained.blocks_host
    chained.prepare(torch.device("cpu"))
    assert log == ["prepare tail on cpu", "prepare user on cpu"]
    assert not chain(Part("a", log), Part("b", log)).blocks_host


def host_iterator():
    return FastLoader(TensorDataset(n=8), batch_size=4)._get_iterator()


def test_without_a_device_or_pinning_the_consumer_reads_the_host_iterator():
    host = host_iterator()
    assert DeviceStage(Telemetry()).wrap(host, StagePlan()) is host


def test_on_a_device_batches_are_copied_ahead_and_the_users_transform_seeded():
    class Seeded:
        seed_given = None

        def __call__(self, batch):
            return batch

        def seed(self, base_seed):
            self.seed_given = base_seed

    user = Seeded()
    host = host_iterator()
    wrapped = DeviceStage(Telemetry()).wrap(host, StagePlan(
        target=torch.device("cpu"), transform=user, gpu_transform=user, prefetch_depth=1))
    assert isinstance(wrapped, DeviceIterator) and isinstance(wrapped._copier, CpuCopier)
    assert user.seed_given == host.base_seed
    assert [images.shape[0] for images, _ in wrapped] == [4, 4]


def test_the_device_is_resolved_once_then_kept():
    stage = DeviceStage(Telemetry())
    assert stage.target(None) is None and stage.cuda_index() is None
    assert stage.target(torch.device("cpu")) == torch.device("cpu")
    assert stage.target(None) == torch.device("cpu")  # kept, whatever is asked later
