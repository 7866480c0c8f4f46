"""``worker_mode="ray"`` without a cluster: the form a batch takes in Ray's object store, and
the loader's checks of Ray's arguments. The cluster tests are in ``test_ray_cluster.py``."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same
from sample_datasets import MixedDataset, ShardedIterable, TensorDataset

from fastfeed import FastLoader, codec
from fastfeed._install import install_line
from fastfeed.backends.ray.wire import ship, unship
from fastfeed.slots import Lease

ROOT = Path(__file__).resolve().parents[1]


def arrived_shipped(batch):
    """``batch`` shipped, as it reaches the main process: its buffers read-only copies."""
    shipped = ship(batch)
    buffers: list[pickle.PickleBuffer] = []
    blob = pickle.dumps(shipped, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(blob, buffers=[memoryview(bytes(b.raw())) for b in buffers])


def through_object_store(batch):
    """``batch`` shipped, carried as Ray carries it, and rebuilt over the object store."""
    arrived = arrived_shipped(batch)
    return arrived, unship(arrived)[0]


def test_a_batch_arrives_equal_with_its_views_and_identities():
    x = torch.arange(24_000, dtype=torch.float64).reshape(4000, 6)
    batch = {
        "views": (x, x[1], x.t(), x),
        "half": torch.arange(6, dtype=torch.float16)[1::2],
        "empty": torch.empty(0, 3),
        "array": np.arange(10, dtype=np.int32),
        "strided": np.arange(12).reshape(3, 4)[:, ::2],
        "leaf": torch.ones(2, requires_grad=True),
        "text": ["a", "b"],
    }
    shipped, arrived = through_object_store(batch)
    assert_same(batch, arrived)
    views = arrived["views"]
    assert views[0] is views[3], "one tensor twice is one tensor"
    assert views[1].untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr()
    assert views[2].stride() == (1, 6) and views[2].storage_offset() == 0
    assert arrived["leaf"].requires_grad
    # Three storages and one array out of band; none of their bytes in the pickled structure.
    assert len(shipped.buffers) == 4
    assert len(shipped.payload) < 2000


def in_memory(view, memory):
    start = memory.ctypes.data
    address = view.data_ptr() if isinstance(view, torch.Tensor) else view.ctypes.data
    return start <= address < start + memory.nbytes


@pytest.mark.parametrize("batch", [
    MixedDataset()[3], TensorDataset()[0],
    {"rows": torch.arange(1000.)[::7], "pair": (torch.ones(3), torch.zeros(5)),
     "array": np.arange(7.0), "views": (torch.arange(6.0), torch.arange(6.0)[2:])}])
def test_a_batch_lands_once_in_a_slot_of_the_size_it_asked_for(batch, monkeypatch):
    """What the main process sizes a slot by is enough, every tensor and array of the batch
    is a view of the slot, and the batch is unpickled once: never pickled again here, as the
    slot codec of process workers would (the batch would then be unpickled twice)."""
    from fastfeed.backends.ray import landing

    def refused(*args, **kwargs):
        raise AssertionError("the landing went through the slot codec")

    unshipped = []

    def counted(*args, **kwargs):
        unshipped.append(args)
        return unship(*args, **kwargs)

    shipped = arrived_shipped(batch)
    lease = Lease(np.zeros(shipped.required, dtype=np.uint8))
    monkeypatch.setattr(codec._SlotPickler, "dump", refused)
    monkeypatch.setattr(codec._SlotUnpickler, "load", refused)
    monkeypatch.setattr(landing, "unship", counted)
    landed = landing.Landing().land(shipped, lease)
    assert len(unshipped) == 1
    assert_same(batch, landed)
    leaves = [leaf for leaf in (landed if isinstance(landed, (tuple, list)) else
                                [*landed.values()]) for leaf in
              (leaf if isinstance(leaf, tuple) else (leaf,))
              if isinstance(leaf, (torch.Tensor, np.ndarray))]
    assert leaves and all(in_memory(leaf, lease.memory) for leaf in leaves)
    assert {id(v) for v in lease.views} >= {id(leaf) for leaf in leaves}


def test_worker_mode_ray_without_ray_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ImportError, match=re.escape(install_line("ray"))):
        FastLoader(TensorDataset(), num_workers=2, worker_mode="ray")


def test_ray_options_need_worker_mode_ray():
    with pytest.raises(ValueError, match="worker_mode='ray'"):
        FastLoader(TensorDataset(), num_workers=2, ray_options={"num_cpus": 1})
    with pytest.raises(ValueError, match="worker_mode should be one of"):
        FastLoader(TensorDataset(), num_workers=2, worker_mode="rays")


@pytest.mark.clients
@pytest.mark.parametrize(("options", "error", "match"), [
    pytest.param([("num_cpus", 1)], TypeError, "dict", id="not-a-dict"),
    pytest.param({"max_restarts": 3}, ValueError, "restarts a lost one itself", id="ours"),
    pytest.param({"num_cpus": -1}, ValueError, "negative", id="negative-cpus"),
    pytest.param({"resources": {"CPU": 1}}, ValueError, "num_cpus", id="cpu-as-resource"),
])
def test_ray_options_are_checked_when_the_loader_is_built(options, error, match):
    pytest.importorskip("ray", reason="needs Ray (the client environment)")
    with pytest.raises(error, match=match):
        FastLoader(TensorDataset(), num_workers=2, worker_mode="ray", ray_options=options)


@pytest.mark.clients
def test_without_a_cluster_the_first_iteration_says_to_call_ray_init(monkeypatch):
    ray = pytest.importorskip("ray", reason="needs Ray (the client environment)")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    loader = FastLoader(ShardedIterable(), num_workers=2, worker_mode="ray")
    with pytest.raises(RuntimeError, match=r"call ray\.init\(address=\.\.\.\)"):
        iter(loader)
    with pytest.raises(RuntimeError, match=r"ray\.init"):
        FastLoader(TensorDataset(), num_workers="auto", worker_mode="ray")


@pytest.mark.clients
def test_an_actor_serves_whatever_the_driver_pid_names_on_its_node():
    """An actor on another machine than the driver: the driver's pid names no process there
    (or someone else's), and the actor's loop must not take it for its main process. The
    worker runs in a process of its own, as an actor does (it sets up its process as a
    worker's: seeds, threads, ``get_worker_info()``)."""
    pytest.importorskip("ray", reason="needs Ray (the client environment)")
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # its pid now names no process, as the driver's on another node
    actor = f"""
from torch.utils.data import default_collate
from fastfeed.backends.ray.actor import RayWorker
from fastfeed.protocol import Task, WorkerConfig
shared = WorkerConfig(dataset=list(range(8)), iterable=False, auto_collation=True,
                      collate_fn=default_collate, drop_last=False, base_seed=0,
                      worker_init_fn=None, worker_id=0, num_workers=0, main_pid={ended.pid})
print(RayWorker(shared, 0, 1, None).run(Task(0, [2, 3], None)))
"""
    run = subprocess.run([sys.executable, "-c", actor], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "Answer(seq=0" in run.stdout, run.stderr[-3000:]


@pytest.mark.clients
def test_the_benchmark_compares_ray_with_processes(tmp_path):
    """``benchmarks/ray_workers.py`` runs (on the overhead case, which needs no images) and
    tabulates both backends with its profile."""
    pytest.importorskip("ray", reason="needs Ray (the client environment)")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ray_workers.py"), "--configs",
         "overhead-process,overhead-ray", "--repeats", "1", "--epochs", "1", "--profile",
         "--json", str(tmp_path / "runs.json")],
        capture_output=True, text=True, cwd=ROOT, timeout=240, check=False)
    assert out.returncode == 0, out.stderr
    assert "| overhead |" in out.stdout and "| overhead-ray |" in out.stdout
    runs = json.loads((tmp_path / "runs.json").read_text())
    assert runs["overhead-ray"][0]["cores"]["workers"] > 0, "the actors' CPU was not read"


def test_a_batch_lands_on_one_core_and_the_thread_count_comes_back():
    """The landing's torch ops run on one thread (beside busy workers, several contend for
    the cores); the caller's count comes back after, and threads started later get it."""
    from fastfeed.backends.ray.landing import _on_one_core, _thread_counts_are_per_thread

    if not _thread_counts_are_per_thread():
        pytest.skip("torch's thread count is process-wide here: the landing keeps it")
    before = torch.get_num_threads()
    with _on_one_core():
        landing = torch.get_num_threads()
    later = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert (landing, later, torch.get_num_threads()) == (1, [before], before)
