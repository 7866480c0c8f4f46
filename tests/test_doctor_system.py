"""The doctor's machine reading (fastfeed/doctor/system.py), against what the OS and the
workers themselves say for the same processes.

Each worker here measures the CPU it burns with its own thread clock; the reading must hold at
least that, including for workers that started and ended within the window (a loader without
persistent workers starts new ones every epoch), and must agree with the kernel's own account
of the children the process waited for (``getrusage``). No timing thresholds: a share of time
is checked against what the scheduler cannot give (two processes that never sleep, sharing
one core, cannot both run more than half the time).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import resource
import time
from typing import Any

import pytest
import torch
from procs import multiprocessing_helpers
from torch.utils.data import DataLoader, Dataset

from fastfeed.doctor import system
from fastfeed.doctor.system import ProcessTree, machine_busy_s, usage_between

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads Linux's /proc")

TICK = 1 / os.sysconf("SC_CLK_TCK")  # /proc's unit: each figure read is rounded down to it


def burn(seconds: float) -> float:
    """Spin on the CPU for ``seconds`` of this thread's CPU time; the CPU time it took."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass
    return time.thread_time() - start


class Burning(Dataset):
    """Each sample burns CPU in its worker and says how much, as a costly transform does."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(burn(0.01), dtype=torch.float64)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def helpers_cpu_s() -> float:
    """CPU seconds of multiprocessing's helpers (the forkserver, the resource tracker) and of
    the children they have waited for: the forkserver's are the workers, which are not this
    process's children (Python 3.14's default start method)."""
    total = 0.0
    for pid in multiprocessing_helpers()[0]:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15]) * TICK  # utime stime cutime cstime
    return total


def test_workers_that_ended_within_the_window_are_counted():
    # Three epochs of a loader without persistent workers: each epoch's two workers start
    # and end (and are waited for) between the two readings, as in a short-epoch script.
    loader = DataLoader(Burning(), batch_size=2, num_workers=2)
    start, children = ProcessTree.read(), children_cpu_s() + helpers_cpu_s()
    began = time.perf_counter()
    burnt = sum(float(batch.sum()) for _ in range(3) for batch in loader)
    end, children = ProcessTree.read(), children_cpu_s() + helpers_cpu_s() - children
    seconds = time.perf_counter() - began
    usage = usage_between(start, end, seconds)
    assert set(end.workers()) <= set(start.workers())  # the loader's are all gone
    assert usage.cores_used is not None and usage.workers_cpu_s is not None
    # Children this process had before (a test run's helpers) are not the loader's workers.
    def used(pid: int) -> float:
        before, after = start.processes[pid], end.processes[pid]
        return after.cpu_s + after.reaped_s - before.cpu_s - before.reaped_s

    workers_cpu = usage.workers_cpu_s - sum(used(pid) for pid in end.workers())
    # Each worker is rounded down to a tick; the parent's collected time once per reading.
    assert usage.cores_used * seconds >= burnt - 6 * TICK
    assert workers_cpu >= burnt - 6 * TICK
    assert abs(workers_cpu - children) <= 2 * TICK  # the kernel's own account


def _spin(ready: multiprocessing.synchronize.Event, stop: Any, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    ready.set()
    while not stop.value:  # a flag read without a lock: the two never block on each other
        burn(0.001)


def _two_spinners(ready: list[multiprocessing.synchronize.Event], stop: Any, cpu: int) -> None:
    """A training process of its own, whose only children are the two spinning workers."""
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_spin, args=(r, stop, cpu)) for r in ready]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_two_busy_workers_on_one_core_read_as_waiting_for_it():
    # Two workers that never sleep, pinned to the same core: between them they run at most
    # one core's time, and each is always either on the core or waiting for it.
    context = multiprocessing.get_context("fork")
    stop = context.RawValue("b", 0)
    ready = [context.Event() for _ in range(2)]
    training = context.Process(target=_two_spinners,
                                args=(ready, stop, min(os.sched_getaffinity(0))))
    training.start()
    try:
        for event in ready:
            assert event.wait(30)
        start = ProcessTree.read(training.pid)
        if any(t.run_delay_s is None for t in start.processes.values()):
            pytest.skip("this kernel keeps no scheduler statistics")
        began = time.perf_counter()
        time.sleep(2.0)
        end = ProcessTree.read(training.pid)
        usage = usage_between(start, end, time.perf_counter() - began)
    finally:
        stop.value = 1
        training.join(10)
    assert usage.worker_processes == 2 and len(start.workers()) == 2
    assert usage.worker_busy is not None and usage.worker_waiting is not None
    assert usage.worker_busy <= 0.5 + 0.05
    assert usage.worker_waiting >= 0.5 - 0.05
    assert usage.worker_busy + usage.worker_waiting >= 1 - 0.05


def test_the_tree_is_the_same_without_the_kernels_children_lists(monkeypatch):
    loader = DataLoader(Burning(), batch_size=2, num_workers=2, persistent_workers=True)
    iterator = iter(loader)
    next(iterator)  # the workers are up
    listed = ProcessTree.read().processes.keys()
    monkeypatch.setattr(system, "_CHILDREN_LISTED", False)
    scanned = ProcessTree.read().processes.keys()
    del iterator, loader
    assert listed == scanned and len(listed) >= 3


def test_machine_busy_counts_only_this_process_cores(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice, in ticks
    stat.write_text("cpu  60 0 30 900 10 0 0 10 0 0\n"
                    "cpu0 50 0 20 400 5 0 0 10 0 0\n"
                    "cpu1 10 0 10 500 5 0 0 0 0 0\n"
                    "intr 12345\n")
    assert machine_busy_s({0}, str(stat)) == pytest.approx(80 * TICK)
    assert machine_busy_s({0, 1}, str(stat)) == pytest.approx(100 * TICK)
    assert machine_busy_s({0}, str(tmp_path / "missing")) is None


def test_the_report_says_when_the_cores_were_all_busy():
    from fastfeed.doctor.findings import Diagnosis
    from fastfeed.doctor.report import format_report

    # The case: two workers of a 22 ms transform, training waiting 87 % of each step,
    # on two cores that other processes kept busy.
    system = {"cpu_cores": 2, "cores_used": 0.4, "machine_cores_used": 2.0,
              "worker_processes": 2, "worker_busy": 0.13, "worker_waiting": 0.8,
              "main_memory_mb": 100.0, "workers_memory_mb": 150.0, "gpu": [],
              "gpu_status": "no NVML"}
    diagnosis = Diagnosis(outcome="report", script="train.py", verdict="data-bound",
                          stall_fraction=0.87, consumer_samples_per_s=30.0,
                          model_samples_per_s=300.0, system=system,
                          window={"steps": 30, "warmup_batches": 8, "seconds": 9.0,
                                  "stopped": True})
    report = format_report(diagnosis)
    assert ("2 CPU cores, 2.0 in use (0.4 by this training, 1.6 by other processes: all busy)"
            in report)
    assert "2 child processes (workers) 13% on a CPU, 80% waiting for one" in report
    assert ("The workers are CPU-bound on cores that were all in use (1.6 of them by other "
            "processes): they waited for a core 80% of the time. More workers would share the "
            "same cores") in report

    def reported(**changes) -> str:
        return format_report(Diagnosis(**{**vars(diagnosis),
                                          "system": {**system, **changes}}))

    quiet = reported(machine_cores_used=0.5, worker_waiting=0.0)
    assert "all busy" not in quiet and "CPU-bound" not in quiet
    # Busy cores, but workers that mostly sleep (on storage, say): more of them can help.
    sleeping = reported(worker_busy=0.05, worker_waiting=0.2)
    assert "all busy" in sleeping and "CPU-bound" not in sleeping
