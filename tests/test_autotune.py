"""The tuner's decisions on simulated rates (no clocks, no processes), and the measurements
the worker pool feeds it."""

import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from procs import alive
from sample_datasets import SlowDataset
from torch.utils.data import Dataset

from fastfeed import FastLoader
from fastfeed._proc import WorkerSleepMeter, available_cpus
from fastfeed.autotune import (
    TuningWindows,
    Window,
    WorkerTuner,
    initial_workers,
    memory_cap,
)


def simulate(tuner, rate_of, wait_of, idle=1.0, windows=30, sleep=None):
    """Feed the tuner windows whose rate, wait (and idle cores and the workers' sleep, when
    callable) depend only on the worker count."""
    counts = []
    for _ in range(windows):
        n = tuner.workers
        cores = idle(n) if callable(idle) else idle
        asleep = sleep(n) if callable(sleep) else sleep
        counts.append(tuner.observe(Window(rate_of(n), wait_of(n), cores, asleep)))
    return counts


def io_bound(n, cores=2, sample_cpu_ms=0.5, sample_wait_ms=6.0, batch=8, step_ms=4.0,
             main_ms_per_batch=4.0):
    """The issue's I/O case, modelled: ``(batches/s, consumer wait, idle cores)`` with ``n``
    workers. A worker makes a batch in batch × (CPU + wait); the consumer's step bounds the
    rate, and so do the cores, shared by the workers' CPU time and the main process's
    per-batch work (receiving, collating, the step's own CPU)."""
    per_batch_s = batch * (sample_cpu_ms + sample_wait_ms) / 1000
    cpu_per_batch_s = (batch * sample_cpu_ms + main_ms_per_batch) / 1000
    rate = min(n / per_batch_s, 1000 / step_ms, cores / cpu_per_batch_s)
    return rate, 1 - rate * step_ms / 1000, max(0.0, cores - rate * cpu_per_batch_s)


def test_adds_workers_until_the_consumer_stops_waiting():
    rate = lambda n: min(n, 3) * 10.0  # noqa: E731 - three workers saturate the consumer
    wait = lambda n: 0.0 if n >= 3 else 0.5  # noqa: E731
    counts = simulate(WorkerTuner(1, maximum=8), rate, wait)
    assert counts[-1] == 3
    assert max(counts) <= 4


def test_undoes_a_worker_that_does_not_pay():
    rate = lambda n: 20.0  # noqa: E731 - CPU-bound: more workers bring nothing
    wait = lambda n: 0.3  # noqa: E731
    tuner = WorkerTuner(2, maximum=8)
    counts = simulate(tuner, rate, wait)
    assert counts[-1] == 2 and max(counts) == 3
    assert any("did not pay" in line for line in tuner.log)


def test_retires_surplus_workers_and_keeps_the_floor():
    rate = lambda n: 30.0  # noqa: E731 - the consumer is the bottleneck at any count
    wait = lambda n: 0.0 if n >= 2 else 0.2  # noqa: E731
    counts = simulate(WorkerTuner(6, maximum=8), rate, wait)
    assert counts[-1] == 2
    assert counts[-10:] == [2] * 10  # settled, not oscillating


def test_never_exceeds_maximum():
    always_waiting = lambda n: 0.9  # noqa: E731
    assert max(simulate(WorkerTuner(1, maximum=2), lambda n: n * 10.0, always_waiting)) == 2


def test_busy_cores_do_not_block_growth_that_pays():
    # The old gate (add only while half a core idles) stopped this at the first count whose
    # idle cores fell below 0.5, although each added worker raised throughput.
    rate = lambda n: min(n, 10) * 10.0  # noqa: E731
    wait = lambda n: 0.0 if n >= 10 else 0.8  # noqa: E731
    counts = simulate(WorkerTuner(2, maximum=16), rate, wait, idle=0.1, windows=40)
    assert counts[-20:] == [10] * 20
    assert sum(n > 10 for n in counts) <= 6  # trials past the best are undone, and few


@pytest.mark.parametrize("worker_sleep", [None, 6.0 / 6.5])  # unknown, or as measured
def test_reaches_nine_tenths_of_the_best_fixed_count_on_the_io_case(worker_sleep):
    best = max(io_bound(n)[0] for n in range(1, 17))
    tuner = WorkerTuner(2, maximum=16, cores=2)
    counts = simulate(tuner, lambda n: io_bound(n)[0], lambda n: io_bound(n)[1],
                      idle=lambda n: io_bound(n)[2], windows=60, sleep=worker_sleep)
    assert io_bound(counts[-1])[0] >= 0.9 * best, tuner.log
    assert counts[-10:] == [counts[-1]] * 10  # settled


def test_cpu_bound_workers_stay_within_the_cores_on_a_shared_machine():
    # Other users' processes hold the cores: each added CPU-bound worker takes a bigger share
    # of them, so throughput rises with the count, but the workers never sleep.
    rate = lambda n: 10.0 * n  # noqa: E731
    wait = lambda n: 0.5  # noqa: E731
    tuner = WorkerTuner(2, maximum=16, cores=2)
    assert max(simulate(tuner, rate, wait, idle=0.0, sleep=0.0)) == 2
    # Half asleep (half I/O): room for twice the cores.
    assert simulate(WorkerTuner(2, maximum=16, cores=2), rate, wait, sleep=0.5)[-1] == 4
    # Without the sleep measurement the verdict alone cannot tell: it keeps them.
    assert simulate(WorkerTuner(2, maximum=16, cores=2), rate, wait, sleep=None)[-1] > 2


def _child(code):
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="needs Linux schedstat")
def test_sleep_meter_tells_sleeping_workers_from_computing_ones():
    # Long sleeps: on a loaded machine (a parallel run) each wake-up waits for a core, which
    # counts as running; at 0.05 s a sleep, those waits came to over half the time.
    sleeper = _child("import time\nwhile True: time.sleep(0.25)")
    spinner = _child("while True: pass")
    try:
        time.sleep(0.3)
        meters = {p.pid: WorkerSleepMeter() for p in (sleeper, spinner)}
        assert all(m.sleep_fraction([pid]) is None for pid, m in meters.items())  # a start
        time.sleep(0.5)
        asleep = {pid: m.sleep_fraction([pid]) for pid, m in meters.items()}
        # Waiting for a core (a busy machine) counts as computing, not as sleep.
        assert asleep[sleeper.pid] > 0.5 > asleep[spinner.pid]
        assert WorkerSleepMeter().sleep_fraction([2**22 + 12345]) is None  # no such task
    finally:
        for child in (sleeper, spinner):
            child.kill()
            child.wait()


def test_cpu_bound_on_busy_cores_tries_once_then_stays():
    # Two cores saturated: a third worker brings nothing, whatever the consumer's wait.
    rate = lambda n: min(n, 2) * 10.0  # noqa: E731
    tuner = WorkerTuner(2, maximum=16)
    counts = simulate(tuner, rate, lambda n: 0.5, idle=0.0, windows=40)
    assert max(counts) == 3 and counts.count(3) <= 1 + tuner.settle
    assert counts[-30:] == [2] * 30


def test_initial_guess_is_within_bounds():
    start, maximum = initial_workers()
    assert 1 <= start <= maximum


def test_io_bound_workers_grow_past_the_cores():
    # Workers that wait on storage: throughput rises to 10 workers while the two cores idle.
    rate = lambda n: min(n, 10) * 10.0  # noqa: E731
    wait = lambda n: 0.0 if n >= 10 else 0.8  # noqa: E731
    cores = 2
    tuner = WorkerTuner(cores, maximum=16)
    counts = simulate(tuner, rate, wait, idle=1.6, windows=40)
    assert counts[-20:] == [10] * 20
    assert sum(n > 10 for n in counts) <= 6  # trials past the best are undone, and few
    assert all("trying" in line for line in tuner.log[:3])  # 2 -> 4 -> 7 -> 13, then retires to 10


def test_a_new_iterator_keeps_what_the_tuner_learned():
    tuner = WorkerTuner(2, maximum=8)
    simulate(tuner, lambda n: 20.0, lambda n: 0.3)  # a third worker did not pay
    tuner.restart(2)
    assert max(simulate(tuner, lambda n: 20.0, lambda n: 0.3)) == 2


def test_starts_where_a_user_would():
    start, maximum = initial_workers()
    cores = available_cpus()
    assert start == min(cores, 8, maximum)
    assert maximum > cores or maximum == memory_cap()  # room to grow past the cores


class SpinDataset(Dataset):
    """Computes per sample (a busy loop): a CPU-bound worker that never sleeps."""

    def __init__(self, n: int = 600, spin_s: float = 0.002):
        self.n, self.spin_s = n, spin_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        end = time.perf_counter() + self.spin_s
        while time.perf_counter() < end:
            pass
        return torch.tensor(i)


class RecordingTuner(WorkerTuner):
    """A real tuner that keeps the windows the pool feeds it and the counts it answers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.windows: list[Window] = []
        self.counts: list[int] = []

    def observe(self, window):
        self.windows.append(window)
        self.counts.append(super().observe(window))
        return self.counts[-1]


def tuned_epoch(dataset, worker_mode, maximum=3):
    """One epoch of ``num_workers="auto"``, from one worker, by a tuner told of one core (so
    that a CPU-bound worker fills the cores it knows of); returns the tuner and the loader's
    worker count at the end."""
    loader = FastLoader(dataset, batch_size=4, num_workers="auto", worker_mode=worker_mode)
    loader.num_workers = 1
    tuner = RecordingTuner(1, maximum=maximum, cores=1)
    loader._planner.carry_over.tuner = tuner
    for _ in loader:
        pass
    return tuner, loader.stats().workers


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="needs Linux schedstat")
@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_pool_feeds_the_workers_sleep_to_the_tuner(worker_mode):
    sleeping, sleeping_workers = tuned_epoch(SlowDataset(n=800, delay=0.002), worker_mode)
    spinning, spinning_workers = tuned_epoch(SpinDataset(), worker_mode)
    for tuner, workers in ((sleeping, sleeping_workers), (spinning, spinning_workers)):
        assert len(tuner.windows) >= 3
        # Every window, the first included (the meter's first reading is at the workers'
        # start), carries the measurement.
        assert all(w.worker_sleep is not None for w in tuner.windows), tuner.windows
        assert all(1 <= n <= 3 for n in tuner.counts) and 1 <= workers <= 3, tuner.log
    asleep = statistics.median(w.worker_sleep for w in sleeping.windows)
    computing = statistics.median(w.worker_sleep for w in spinning.windows)
    assert asleep > computing, (sleeping.windows, spinning.windows)
    # The consumer waits on both. Spinning workers already fill the one core the tuner
    # knows of: no trial; sleeping ones grow past it (a second worker doubles throughput).
    assert spinning.counts == [1] * len(spinning.counts), spinning.log
    assert max(sleeping.counts) > 1, sleeping.log


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="needs Linux schedstat")
def test_sleep_meter_skips_tasks_that_exited():
    child = _child("import time\ntime.sleep(30)")
    other = _child("import time\ntime.sleep(30)")
    try:
        meter = WorkerSleepMeter([child.pid, other.pid])  # the first reading
        child.kill()
        child.wait()
        assert not alive(child.pid)
        time.sleep(0.05)
        # The exited task is left out, the other still measured.
        assert meter.sleep_fraction([child.pid, other.pid]) is not None
        assert meter.sleep_fraction([child.pid]) is None  # nothing left to measure
    finally:
        for process in (child, other):
            process.kill()
            process.wait()


def test_workers_idle_for_want_of_tasks_are_not_waiting_on_storage(monkeypatch):
    # Two workers asleep half the time: half their time on tasks (blocked in them), or half
    # without a task at all (the main process sets the pace). Only the first is storage.
    def window(busy_share):
        tuner = RecordingTuner(2, maximum=16, cores=2)
        windows = TuningWindows(tuner, [], waited=0.0, worker_busy=0.0)
        monkeypatch.setattr(windows._sleep, "sleep_fraction", lambda tasks: 0.5)
        time.sleep(0.6)  # one window: its elapsed time is real
        elapsed = time.perf_counter() - windows._start
        for _ in range(3):
            windows.delivered(0.0, [1, 2], worker_busy=busy_share * elapsed * 2)
        return tuner.windows[0].worker_sleep

    assert window(busy_share=1.0) == pytest.approx(0.5, abs=0.05)
    assert window(busy_share=0.5) == pytest.approx(0.0, abs=0.05)
