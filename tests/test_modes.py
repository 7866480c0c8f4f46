"""Thread workers, num_workers="auto", deterministic=True, stats(), and the backend registry."""

import gc
import logging
import re
import threading
from pathlib import Path

import pytest
import torch
from helpers import assert_same, compare
from procs import wait_until
from sample_datasets import (
    DetectionDataset,
    FailingDataset,
    GetItemsDataset,
    RandomAugmentDataset,
    ShardedIterable,
    SlowDataset,
    TensorDataset,
    ThreadInfoDataset,
    detection_collate,
)
from torch.utils.data import DataLoader

import fastfeed
from fastfeed import FastLoader, LoaderStats
from fastfeed.backends import registry
from fastfeed.backends.thread import ThreadBackend
from fastfeed.slots import slot_budget

THREADS = {"worker_mode": "thread"}


@pytest.mark.parametrize("dataset", [TensorDataset, GetItemsDataset])
@pytest.mark.parametrize("persistent", [False, True])
def test_thread_workers_match_torch(dataset, persistent):
    compare(dataset, batch_size=4, num_workers=2, shuffle=True, generator=3, epochs=2,
            persistent_workers=persistent, fast=THREADS)


def test_thread_workers_custom_collate_and_in_order_false():
    compare(DetectionDataset, batch_size=4, num_workers=2, collate_fn=detection_collate,
            fast=THREADS)
    got = list(FastLoader(TensorDataset(), batch_size=3, num_workers=2, in_order=False,
                          worker_mode="thread"))
    assert sorted(b[1][0].item() for b in got) == list(range(0, 37, 3))


def test_thread_worker_errors_and_timeout():
    with pytest.raises(KeyError, match="bad index 5"):
        list(FastLoader(FailingDataset(bad=5), batch_size=2, num_workers=2, worker_mode="thread"))
    with pytest.raises(RuntimeError, match=r"timed out after 0\.3 seconds"):
        next(iter(FastLoader(SlowDataset(delay=2), num_workers=1, timeout=0.3,
                             worker_mode="thread")))


@pytest.mark.parametrize("drop", ["", "del iterator"])
def test_the_process_exits_cleanly_with_thread_workers_mid_epoch(drop):
    """A script that stops mid-epoch and ends, its iterator kept or dropped: the workers are
    inside torch ops then, and a daemon thread still in C++ code when the interpreter finalizes
    aborts the process (pthread_exit). Every run aborted before the workers were joined at
    exit."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    code = (f"import sys; sys.path[:0] = [{str(root)!r}, {str(root / 'tests')!r}]\n"
            "import torch\nfrom fastfeed import FastLoader\n"
            "class Busy(torch.utils.data.Dataset):\n"
            "    def __len__(self): return 10_000\n"
            "    def __getitem__(self, i): return torch.ones(3, 640, 640).mul(2).clone()\n"
            "iterator = iter(FastLoader(Busy(), batch_size=8, num_workers=2, "
            "worker_mode='thread'))\n"
            f"next(iterator)\n{drop}\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]


def test_worker_info_in_threads():
    batches = list(FastLoader(ThreadInfoDataset(), batch_size=None, num_workers=2,
                              worker_mode="thread"))
    assert {b["id"] for b in batches} == {0, 1}
    assert {b["method"] for b in batches} == {"thread"}


class BlocksAt(torch.utils.data.Dataset):
    """Sample ``at`` waits for ``gate``: its worker thread holds its task's slot meanwhile."""

    def __init__(self, at: int):
        self.at, self.reached, self.gate = at, threading.Event(), threading.Event()

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == self.at:
            self.reached.set()
            self.gate.wait()
        return torch.full((3, 8, 8), i)


def test_a_thread_still_in_its_task_at_shutdown_keeps_its_slot_until_it_ends():
    """A worker thread cannot be stopped inside ``__getitem__``, and may still write its task's
    slot after the pool shuts down: the slot returns once the thread has ended, not before."""
    dataset = BlocksAt(at=-1)
    loader = FastLoader(dataset, batch_size=4, num_workers=1, worker_mode="thread")
    list(loader)  # the slot pool learns the batch size
    slot_pool = loader._planner.slot_pool
    dataset.at = 8  # the third batch, in flight once the first is delivered
    iterator = iter(loader)
    next(iterator)
    assert dataset.reached.wait(timeout=30)
    iterator._crew.shutdown()  # the thread is in the third batch's fetch, holding its slot
    del iterator
    gc.collect()
    assert slot_pool.occupancy[0] == 2  # the third batch's, and the second's (never received)
    dataset.gate.set()
    assert wait_until(lambda: gc.collect() is not None and slot_pool.occupancy[0] == 0)


class ThreadSetup(torch.utils.data.Dataset):
    """Each sample: how many threads a gather called where it was read may use, and whether
    that thread said it shares the GIL with busy ones."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        from fastfeed._stack import copy_threads, shares_the_gil

        return torch.tensor([copy_threads(), shares_the_gil()])


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_each_worker_sets_up_its_thread(mode):
    """Two workers' gathers each take half the cores, not every core each (four threads on
    two cores, with thread workers); the main thread keeps every core for its own. Worker
    threads read the lazy bits without releasing the GIL; worker processes, and the training
    thread, with is_neg()/is_conj(), which make no pybind object (whose registration would
    copy a forked worker's inherited pages)."""
    from fastfeed._proc import available_cpus
    from fastfeed._stack import copy_threads, shares_the_gil

    batches = list(FastLoader(ThreadSetup(), batch_size=2, num_workers=2, worker_mode=mode))
    share = max(1, available_cpus() // 2)
    assert torch.cat(batches).tolist() == [[share, mode == "thread"]] * 8
    assert copy_threads() == 0 and not shares_the_gil()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"worker_mode": "fibers"}, "worker_mode"),
    ({"num_workers": 2, "worker_mode": "thread", "deterministic": True}, "threads share"),
    ({"log_every": 0}, "log_every"),
])
def test_bad_mode_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FastLoader(TensorDataset(), **kwargs)
    with pytest.raises(ValueError, match="map-style"):
        FastLoader(ShardedIterable(), num_workers=2, worker_mode="thread")


def test_deterministic_samples_do_not_depend_on_the_worker():
    def run(workers):
        loader = FastLoader(RandomAugmentDataset(), batch_size=4, num_workers=workers,
                            deterministic=True, generator=torch.Generator().manual_seed(1))
        return list(loader)

    one, two = run(1), run(2)
    assert_same(one, two)
    # In the main process too: the same produce step, the same per-sample seeds ...
    torch.manual_seed(5)
    before = torch.rand(3)
    torch.manual_seed(5)
    assert_same(run(0), two)
    # ... and the training loop's own random stream is left as it was.
    assert torch.equal(torch.rand(3), before)
    # ... while without it, the draws follow the worker that happens to read the sample.
    plain = [list(FastLoader(RandomAugmentDataset(), batch_size=4, num_workers=w,
                             generator=torch.Generator().manual_seed(1))) for w in (1, 2)]
    assert not all(torch.equal(a, b) for a, b in zip(*plain, strict=True))


def test_auto_workers_keep_torchs_order_and_grow_when_starved():
    # Sleeping samples: the consumer waits while cores idle, so a second worker pays.
    loader = FastLoader(SlowDataset(n=600, delay=0.01), batch_size=1, num_workers="auto")
    assert isinstance(loader.num_workers, int) and loader.num_workers >= 1
    expected = list(DataLoader(SlowDataset(n=600, delay=0.0), batch_size=1))
    start = loader.num_workers
    got = list(loader)
    assert_same(expected, got)
    stats = loader.stats()
    if start < loader._max_workers:
        # Whether the added worker is kept rests on measured rates (tested with a fake clock in
        # test_autotune.py); here, on a busy machine, it may be undone.
        assert stats.decisions and "consumer waits" in stats.decisions[0], stats.decisions
        assert loader.num_workers >= start


def test_worker_mode_auto_tries_both_then_keeps_one():
    loader = FastLoader(TensorDataset(n=64), batch_size=4, num_workers=2, worker_mode="auto")
    modes = []
    for _ in range(3):
        list(loader)
        modes.append(loader._telemetry.worker_mode)
    assert modes[:2] == ["process", "thread"]
    assert modes[2] in ("process", "thread")
    assert any("worker_mode auto" in d for d in loader.stats().decisions)


def boxes_first_collate(samples):
    """Per-box tensors first, as Ultralytics' sorted keys put them: 3 boxes per image."""
    return {"batch_idx": torch.arange(3 * len(samples)), "img": torch.zeros(len(samples), 8),
            "im_file": tuple(str(i) for i in range(len(samples)))}


@pytest.mark.parametrize("collate_fn", [boxes_first_collate, lambda s: [str(i) for i in s]],
                         ids=["detection", "no-tensors"])
def test_stats_count_samples_not_boxes(collate_fn):
    loader = FastLoader(TensorDataset(n=10), batch_size=4, collate_fn=collate_fn)
    list(loader)
    assert loader.stats().samples == 10


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("mode", ["process", "thread"])
def test_stats_are_consistent(num_workers, mode):
    loader = FastLoader(TensorDataset(n=37), batch_size=4, num_workers=num_workers,
                        worker_mode=mode, persistent_workers=num_workers > 0)
    for _ in range(2):
        for _ in loader:
            pass
    stats = loader.stats()
    assert isinstance(stats, LoaderStats)
    assert stats.batches == 2 * len(loader) and stats.samples == 2 * 37
    assert 0.0 <= stats.wait_fraction <= 1.0 and 0.0 <= stats.worker_utilization <= 1.0
    assert stats.stage_ms["fetch"] > 0 and stats.stage_ms["collate"] > 0
    assert stats.workers == num_workers
    assert stats.gpu == [] and stats.gpu_status  # no NVML here: a reason, no exception
    assert "samples/s" in str(stats) and "stall" in stats.summary()
    if num_workers and mode == "process":  # the batches went through a slot pool, a bounded one
        assert 0 < stats.ring_slots <= slot_budget(loader.prefetch_factor * num_workers)
        assert stats.ring_mb > 0
    assert loader.stats(reset=True).batches == stats.batches
    assert loader.stats().batches == 0


def test_stats_on_the_device_path_count_the_transfer():
    loader = FastLoader(TensorDataset(), batch_size=4, num_workers=2, device="cpu")
    list(loader)
    stats = loader.stats()
    assert stats.batches == len(loader) and stats.stage_ms["transfer"] > 0


def test_log_every_logs_a_summary(caplog):
    # pytest configures logging, so the summary goes to the "fastfeed" logger at INFO.
    with caplog.at_level(logging.INFO, logger="fastfeed"):
        list(FastLoader(TensorDataset(n=20), batch_size=2, num_workers=0, log_every=5))
    lines = [r.message for r in caplog.records if r.name == "fastfeed"]
    assert len(lines) == 2 and all("samples/s" in line for line in lines)


def test_log_every_prints_without_logging_configured(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = (f"import sys; sys.path[:0] = [{str(root)!r}, {str(root / 'tests')!r}]\n"
            "from sample_datasets import TensorDataset\nfrom fastfeed import FastLoader\n"
            "list(FastLoader(TensorDataset(n=20), batch_size=2, log_every=5))")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stderr
    assert err.count("fastfeed:") == 2


class OneAtATimeBackend(ThreadBackend):
    """A backend a user of the registry might add: here, thread workers under another name."""

    name = "one-at-a-time"


def test_a_new_backend_is_its_class_and_a_registry_entry(monkeypatch):
    """Nothing outside the backend and the registry needs to know a mode's name: the loader
    checks it, plans with it and runs it from the registry alone."""
    monkeypatch.setitem(registry._BACKENDS, OneAtATimeBackend.name, OneAtATimeBackend)
    compare(TensorDataset, batch_size=4, num_workers=2, shuffle=True, generator=5,
            fast={"worker_mode": OneAtATimeBackend.name})
    loader = FastLoader(TensorDataset(), batch_size=4, num_workers=2,
                        worker_mode=OneAtATimeBackend.name)
    list(loader)
    assert loader.stats().worker_mode == OneAtATimeBackend.name
    with pytest.raises(ValueError, match="map-style"):  # its refusals are its base's
        FastLoader(ShardedIterable(), num_workers=2, worker_mode=OneAtATimeBackend.name)


def test_no_worker_mode_is_compared_by_name_outside_the_backends():
    """What a mode means is asked of its backend's traits; only the backends and the registry
    name modes (the loader's default and docs aside)."""
    root = Path(fastfeed.__file__).parent
    compared = re.compile(r"""(==|!=|\bin\b)\s*\(?["'](process|thread|ray)["']""")
    offenders = [f"{path.relative_to(root)}:{number}"
                 for path in root.rglob("*.py") if "backends" not in path.parts
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if compared.search(line)]
    assert offenders == []
