"""``worker_mode="ray"`` on a Ray cluster on this machine (``ray.cluster_utils.Cluster``, CPU
only: a head node, a worker node, and a third node that goes away): the same batches as torch's
DataLoader side by side, nothing lost and nothing repeated when a node goes away mid-epoch,
and no actor or Ray process left behind.

One cluster serves the module (it takes about ten seconds to start); each test checks that the
loaders it made left no actor running.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import sys
import time
import warnings
from pathlib import Path

import pytest
import sample_datasets
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from clients import labelled_jpegs
from helpers import assert_same, compare, run_epochs
from sample_datasets import (
    BusyAfterFirst,
    FailingDataset,
    InitTagDataset,
    MixedDataset,
    TensorDataset,
    UnevenIterable,
    record_worker_init,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from fastfeed import FastLoader

ray = pytest.importorskip("ray", reason="needs Ray (the client environment)")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

pytestmark = [pytest.mark.clients, pytest.mark.timeout(120)]

# The test datasets travel by value: the cluster's workers cannot import the tests' modules.
ray.cloudpickle.register_pickle_by_value(sample_datasets)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Actors on the worker node, one CPU each: the custom resource places them there.
ON_WORKER_NODE = {"num_cpus": 1, "resources": {"cpu_node": 1}}
# Lost nodes are noticed in about a second, not after Ray's default health-check failures.
FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 300,
                      "health_check_failure_threshold": 3}


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": 2, "_system_config": FAST_HEALTH_CHECKS})
    cluster.add_node(num_cpus=2, resources={"cpu_node": 2})
    processes = [p.process for node in cluster.list_all_nodes()
                 for kind in node.all_processes.values() for p in kind]
    try:
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert all(p.poll() is not None for p in processes), "a Ray process outlived the cluster"


def no_actor_running(wait: float = 10.0) -> bool:
    """Whether every actor fastfeed started is gone (waiting up to ``wait`` seconds)."""
    deadline = time.monotonic() + wait
    while True:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        if not any(name.startswith("fastfeed-") for name in names):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def no_actor_left(cluster):
    yield
    gc.collect()
    assert no_actor_running(), "actors outlived their loader"


def test_map_style_dataset_same_batches(cluster):
    """Seeds, get_worker_info(), RNG draws, shuffling, two persistent epochs; the actors run
    where ray_options put them."""
    loader = FastLoader(MixedDataset(), batch_size=4, shuffle=True, num_workers=2,
                        persistent_workers=True, generator=torch.Generator().manual_seed(3),
                        worker_mode="ray", ray_options=ON_WORKER_NODE)
    expected = run_epochs(DataLoader(MixedDataset(), batch_size=4, shuffle=True, num_workers=2,
                                     persistent_workers=True,
                                     generator=torch.Generator().manual_seed(3)), 2, seed=0)
    actual = run_epochs(loader, 2, seed=0)
    assert ray.available_resources().get("cpu_node", 0) == 0, "not on the worker node"
    assert_same(expected, actual)
    assert {b["worker"][0].item() for b in actual[0]} == {0, 1}


def test_worker_init_fn_and_out_of_order_delivery(cluster):
    """worker_init_fn runs in each actor; in_order=False gives torch's batches in whatever
    order they arrive (which worker makes which batch then depends on timing, in torch too, so
    the batches compared there do not say which worker made them)."""
    assert compare(InitTagDataset, batch_size=2, num_workers=2,
                   worker_init_fn=record_worker_init, fast={"worker_mode": "ray"}) == 5
    kwargs = {"batch_size": 3, "num_workers": 2, "in_order": False}
    expected = list(DataLoader(TensorDataset(n=20), **kwargs))
    iterator = iter(FastLoader(TensorDataset(n=20), worker_mode="ray", **kwargs))
    actual = list(iterator)
    assert no_actor_running(), "the epoch ended and its actors still run"
    assert_same(sorted(expected, key=lambda b: b[1][0].item()),
                sorted(actual, key=lambda b: b[1][0].item()))


# A training script's state in a module-level global (this module travels by value, as the
# script's __main__ does): worker_init_fn sets it in each worker, the dataset reads it.
WORKER_OFFSET = 0


def set_worker_offset(worker_id: int) -> None:
    global WORKER_OFFSET
    WORKER_OFFSET = 1000 * (worker_id + 1)


class OffsetByWorker(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i + WORKER_OFFSET])


def test_a_global_set_by_worker_init_fn_reaches_the_dataset(cluster):
    """A common way to give each worker an offset, a handle or a seed: the dataset and
    worker_init_fn share the script's globals in an actor as in a worker process, so the
    dataset reads what worker_init_fn set (not the value from before it ran)."""
    assert compare(OffsetByWorker, batch_size=2, num_workers=2, persistent_workers=True,
                   epochs=2, worker_init_fn=set_worker_offset, fast={"worker_mode": "ray"}) == 12


def test_errors_and_timeout_as_with_worker_processes(cluster):
    """A dataset's exception is raised in its batch's turn, with torch's type and message, and
    iteration goes on; ``timeout`` raises torch's error when no batch comes in time."""
    kwargs = {"batch_size": 2, "num_workers": 2}
    batches = [iter(DataLoader(FailingDataset(), **kwargs)),
               iter(FastLoader(FailingDataset(), worker_mode="ray", **kwargs))]
    for _ in range(2):
        assert_same(*(next(b) for b in batches))
    errors = []
    for iterator in batches:
        with pytest.raises(KeyError) as error:
            next(iterator)
        errors.append(str(error.value).splitlines()[0])
    assert errors[0] == errors[1]
    assert_same(*(list(b) for b in batches))
    loader = FastLoader(BusyAfterFirst(), batch_size=2, num_workers=1, timeout=1,
                        worker_mode="ray")
    with pytest.raises(RuntimeError, match="DataLoader timed out after 1 seconds"):
        list(loader)


def test_iterable_dataset_same_batches(cluster):
    """Replicas sharded by get_worker_info() and interleaved; one ends early, and the tasks
    queued behind its end are cancelled; persistent workers start each replica again."""
    assert compare(UnevenIterable, epochs=2, batch_size=2, num_workers=2,
                   persistent_workers=True, fast={"worker_mode": "ray"}) == 2 * 3


@pytest.fixture
def jpegs(tmp_path):
    """A folder of 16 small JPEGs in two classes, as ImageFolder reads them."""
    for i, (image, label) in enumerate(labelled_jpegs(16, classes=2)):
        (tmp_path / f"class_{label}").mkdir(exist_ok=True)
        (tmp_path / f"class_{label}" / f"{i:03d}.jpg").write_bytes(image)
    return tmp_path


def _accelerated(root, transform):
    from torchvision import datasets

    from fastfeed.vision.accelerate import accelerate

    return accelerate(datasets.ImageFolder(str(root), transform=transform))


def _classic_transforms():
    """The pipelines whose batch tail the main process runs as Ray workers' batches land:
    ToTensor then Normalize (computed into the slot from uint8); v2's ToImage (whose tail runs
    as it is, on the landed uint8 batch). test_accelerate.py checks the tails of more."""
    from torchvision import transforms as T
    from torchvision.transforms import v2

    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    return {
        "ToTensor-Normalize": T.Compose([T.RandomResizedCrop(64), T.RandomHorizontalFlip(),
                                         T.ToTensor(), T.Normalize(mean, std)]),
        "v2-ToImage": v2.Compose([v2.RandomResizedCrop(48), v2.ToImage(),
                                  v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std),
                                  v2.ToPureTensor()]),
    }


def test_accelerated_pipeline_float_batches_equal_stock_and_processes(cluster, jpegs):
    """``fastfeed.vision.accelerate`` without a device: Ray workers ship uint8 batches and the
    main process computes the float tail as it lands each one in its pool slot (a quarter of
    the bytes through the object store); the batches equal, bit for bit, those of torch's
    DataLoader over the same dataset and of worker processes, which finish them themselves.
    The first tasks go without a pool slot, the later ones with one, and a loader without a
    ring lands each batch in memory of its own: every path is taken."""
    pytest.importorskip("torchvision", reason="needs torchvision (the client environment)")
    # 8 batches: the first 2 tasks go before the slot pool knows the batch size, without a slot
    kwargs = {"batch_size": 2, "shuffle": True, "num_workers": 1}
    for name, transform in _classic_transforms().items():
        dataset = _accelerated(jpegs, transform)
        loaders = {"stock": DataLoader(dataset, **kwargs), "process": FastLoader(dataset, **kwargs),
                   "ray": FastLoader(dataset, worker_mode="ray", **kwargs)}
        if name == "ToTensor-Normalize":
            loaders["ray, no slot pool"] = FastLoader(dataset, worker_mode="ray", ring_slots=0,
                                                      **kwargs)
        epochs = {mode: run_epochs(loader, 1, seed=5)[0] for mode, loader in loaders.items()}
        assert epochs["ray"][0][0].dtype == torch.float32, name
        for mode in loaders:
            assert_same(epochs["stock"], epochs[mode])


def test_accelerated_pipeline_with_a_device(cluster, jpegs):
    """``fastfeed.vision.accelerate`` with ``device=``: the workers make uint8 crops, the batch
    tail runs here (the default path, a quarter of the bytes on the wire); the batches are
    those of worker processes."""
    pytest.importorskip("torchvision", reason="needs torchvision (the client environment)")
    dataset = _accelerated(jpegs, _classic_transforms()["ToTensor-Normalize"])
    batches = []
    for mode in ("process", "ray"):
        torch.manual_seed(5)
        batches.append(list(FastLoader(dataset, batch_size=4, shuffle=True, num_workers=2,
                                       device="cpu", worker_mode=mode)))
    assert batches[1][0][0].dtype == torch.float32  # finished here, from uint8
    assert_same(*batches)


def test_resume_mid_epoch(cluster):
    kwargs = {"batch_size": 4, "shuffle": True, "num_workers": 2}
    torch.manual_seed(7)
    expected = list(DataLoader(TensorDataset(), **kwargs))
    torch.manual_seed(7)
    first = FastLoader(TensorDataset(), worker_mode="ray", **kwargs)
    iterator = iter(first)
    head = [next(iterator) for _ in range(3)]
    state = first.state_dict()
    del iterator, first
    second = FastLoader(TensorDataset(), worker_mode="ray", **kwargs)
    second.load_state_dict(state)
    assert_same(expected, head + list(second))


class SlowRandomDataset(Dataset):
    """Random augmentation and a little work per sample, so that tasks are in flight on a
    node when it goes away."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int):
        time.sleep(0.02)
        return {"index": i, "noise": torch.rand(3, 4)}


def _descendants(pids: list[int]) -> set[int]:
    parent_of = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            # The fields after the command's closing parenthesis: state, then the parent.
            parent_of[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found = set(pids)
    while grown := {p for p, parent in parent_of.items() if parent in found} - found:
        found |= grown
    return found - set(pids)


def lose(cluster: Cluster, node) -> None:
    """``node`` goes as a machine goes: every process on it at once. (Killing its Ray daemons
    alone leaves its actors' processes serving their calls, directly from the driver, until
    Ray notices them orphaned: an epoch can end first, and nothing was lost.)"""
    daemons = [p.process.pid for kind in node.all_processes.values() for p in kind]
    actors = _descendants(daemons)
    cluster.remove_node(node, allow_graceful=False)
    for pid in actors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_lost_node_loses_nothing(cluster):
    """A node with both workers on it goes away in the second epoch of persistent workers:
    their unanswered tasks run again on new actors, which start at that epoch, and with
    deterministic=True both epochs are those of a run without the loss."""
    doomed = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    kwargs = {"batch_size": 4, "shuffle": True, "num_workers": 2, "deterministic": True,
              "persistent_workers": True}
    torch.manual_seed(11)
    loader = FastLoader(SlowRandomDataset(), **kwargs)  # worker processes, nothing lost
    expected = [list(loader) for _ in range(2)]
    options = {"num_cpus": 1,  # there while it lives, elsewhere after
               "scheduling_strategy": NodeAffinitySchedulingStrategy(doomed.node_id, soft=True)}
    torch.manual_seed(11)
    loader = FastLoader(SlowRandomDataset(), worker_mode="ray", ray_options=options, **kwargs)
    actual = [list(loader)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        iterator = iter(loader)
        actual.append([next(iterator) for _ in range(3)])
        lose(cluster, doomed)
        actual[1] += list(iterator)
    assert any("was lost" in str(w.message) for w in caught), "the node went with no worker"
    indices = [i for batch in actual[1] for i in batch["index"].tolist()]
    assert sorted(indices) == list(range(48)), "a sample was lost or repeated"
    assert_same(expected, actual)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, address: str, port: int, out: str) -> None:
    """One DDP rank: its own FastLoader on the cluster, side by side with torch's."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        dataset = TensorDataset(n=30)
        loaders = [cls(dataset, batch_size=4, num_workers=1,
                       sampler=DistributedSampler(dataset, shuffle=True, seed=5), **options)
                   for cls, options in ((DataLoader, {}), (FastLoader, {"worker_mode": "ray"}))]
        expected, actual = (list(loader) for loader in loaders)
        assert_same(expected, actual)
        labels = [label for _, batch in actual for label in batch.tolist()]
        gathered: list = [None, None]
        dist.all_gather_object(gathered, labels)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
    finally:
        ray.shutdown()
        dist.destroy_process_group()


def test_two_ddp_ranks_each_with_its_loader_on_the_cluster(cluster, tmp_path):
    out = tmp_path / "labels.json"
    mp.spawn(_rank, args=(cluster.address, _free_port(), str(out)), nprocs=2, join=True)
    shards = [set(labels) for labels in json.loads(out.read_text())]
    assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(30))


def test_num_workers_auto_grows_into_the_clusters_free_cpus(cluster):
    free = int(ray.available_resources()["CPU"])
    loader = FastLoader(TensorDataset(), num_workers="auto", worker_mode="ray")
    assert loader._max_workers == free
    assert 1 <= loader.num_workers <= free
    two_cpus = FastLoader(TensorDataset(), num_workers="auto", worker_mode="ray",
                          ray_options={"num_cpus": 2})
    assert two_cpus._max_workers == free // 2
