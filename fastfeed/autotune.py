"""``num_workers="auto"``: pick a starting worker count, then adjust it from measurements.

The tuner is a hill climber over the worker count, fed one :class:`Window` of measurements
every ``window`` batches. While the consumer waits for data it tries more workers (a step in
proportion to the wait, at most doubling) and keeps them only if throughput rises by at least
``gain``; it retires one while the consumer never waits, and undoes a retirement that made
the consumer wait. A count found wanting becomes a bound for the rest of the tuner's life, so
it settles instead of oscillating; after undoing a move it also holds still for ``cooldown``
windows. Bounds: at least 1 worker, at most what the
memory budget allows and a cap of a few workers per core: more workers than cores pay when
they wait on storage (a network file system, an object store).

Idle cores do not gate the trial: a busy machine says nothing about whether the workers wait
on storage (the per-batch work of the main process and the training step keep the cores busy
while I/O-bound workers sleep), and the verdict on throughput does. On CPU-bound data the
trial costs a few windows and a count that did not pay is never tried again. Where the window
carries the workers' sleep share (:class:`~fastfeed._proc.WorkerSleepMeter`), no trial asks
for more cores than there are: on a shared machine, CPU-bound workers past the cores raise
throughput only by taking the cores from other processes. The decision logic takes numbers,
not clocks, so it is unit-tested on simulated rates; the meters are in :mod:`fastfeed._proc`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastfeed._proc import (
    CpuMeter,
    WorkerSleepMeter,
    available_cpus,
    available_memory,
    resident_memory,
)

__all__ = ["TuningWindows", "Window", "WorkerTuner", "available_cpus", "initial_workers",
           "memory_cap"]

# A worker is budgeted at the main process's RSS (it is a fork of it) and at least this much.
_MIN_WORKER_BYTES = 256 << 20


def memory_cap(share: float = 0.5) -> int:
    """Workers that fit in ``share`` of available memory, each budgeted at this RSS."""
    available = available_memory()
    if available is None:
        return available_cpus()
    worker = max(resident_memory() or 0, _MIN_WORKER_BYTES)
    return max(1, int(available * share) // worker)


# Windows at one count whose mean is the yardstick for the next move's verdict.
_RATES_KEPT = 4

# Workers per core the tuner may reach, when they wait on I/O rather than compute.
_WORKERS_PER_CORE = 4
_MAX_WORKERS = 64


def initial_workers() -> tuple[int, int]:
    """``(start, maximum)``: start where a user would (a worker per core, at most 8), so that
    "auto" never begins below a plain ``num_workers=<cores>``; the maximum leaves room for
    I/O-bound workers, within the memory budget."""
    cores = available_cpus()
    budget = memory_cap()
    maximum = max(1, min(max(16, _WORKERS_PER_CORE * cores), _MAX_WORKERS, budget))
    return max(1, min(cores, 8, maximum)), maximum


@dataclass(frozen=True)
class Window:
    """Measurements over one window of batches."""

    batches_per_s: float
    wait_fraction: float  # consumer's share of wall time spent waiting for data
    idle_cores: float | None = None  # for the log only: None where unknown
    # The workers' share of wall time spent blocked while working on a task (on storage,
    # say): neither running, nor waiting for a core, nor idle for want of a task (see
    # TuningWindows). None where unknown.
    worker_sleep: float | None = None


class WorkerTuner:
    """Decides the worker count from successive windows.

    Args:
        start: the current worker count.
        maximum: never more workers than this.
        minimum: never fewer.
        wait_high: wait fraction above which the consumer is starved.
        wait_low: wait fraction below which workers are surplus.
        gain: relative throughput gain added workers must bring to stay.
        cooldown: windows to hold still after undoing a move.
        cores: the cores the workers share (default: the CPU affinity mask's); with the
            windows' ``worker_sleep``, no trial asks for more cores than these.
        settle: windows to skip after adding workers before judging them: they hold the new
            workers' start-up (a process takes a few hundred milliseconds on a busy machine),
            and the batches queued behind its first, which would undervalue it.
    """

    def __init__(self, start: int, maximum: int, minimum: int = 1, wait_high: float = 0.05,
                 wait_low: float = 0.01, gain: float = 0.05, cooldown: int = 5,
                 settle: int = 2, cores: int | None = None) -> None:
        self.workers = max(minimum, min(start, maximum))
        self.minimum, self.maximum = minimum, maximum
        self.wait_high, self.wait_low = wait_high, wait_low
        self.gain, self.cooldown, self.settle = gain, cooldown, settle
        self.cores = cores or available_cpus()
        self._last_move = 0  # workers added (> 0) or retired (< 0) by the last move, 0 none
        self._rates: list[float] = []  # batches/s of the windows at the current count
        self._before: float | None = None  # batches/s before the last move
        self._hold = 0
        self._settling = 0  # windows still to skip before the verdict on added workers
        self.log: list[str] = []

    def restart(self, workers: int) -> None:
        """A new iterator starts ``workers`` workers: keep the bounds learned so far, forget
        a move still waiting for its verdict (its windows were cut short)."""
        self.workers = max(self.minimum, min(workers, self.maximum))
        self._last_move, self._before, self._hold, self._settling = 0, None, 0, 0
        self._rates = []

    def observe(self, window: Window) -> int:
        """Feed one window; return the worker count to use from now on."""
        if self._settling:
            self._settling -= 1
            return self.workers
        self._rates = [*self._rates[-(_RATES_KEPT - 1):], window.batches_per_s]
        move, reason = self._decide(window)
        if move:
            # The rate before a move is the mean of the windows at this count: one window
            # on a busy machine is too noisy a yardstick for a 5 % verdict.
            self._before = sum(self._rates) / len(self._rates)
            self._rates = []
            self._settling = self.settle if self._last_move > 0 else 0
            self.workers += move
            self.log.append(f"{self.workers - move} -> {self.workers} workers: {reason}")
        return self.workers

    def _decide(self, w: Window) -> tuple[int, str]:
        last, self._last_move = self._last_move, 0
        if last > 0 and self._before is not None:
            if w.batches_per_s < self._before * (1 + self.gain):
                self._hold = self.cooldown
                self.maximum = self.workers - 1  # this count did not pay: do not retry it
                return -last, (f"the added workers did not pay ({self._before:.1f} -> "
                               f"{w.batches_per_s:.1f} batches/s)")
            self._before = None
        if last < 0 and self._before is not None:
            slower = w.batches_per_s < self._before * (1 - self.gain)
            if w.wait_fraction > self.wait_high or slower:
                self._hold = self.cooldown
                self.minimum = self.workers + 1  # fewer starved the consumer: stay above
                return +1, f"retiring made the consumer wait ({100 * w.wait_fraction:.0f}%)"
            self._before = None
        if self._hold:
            self._hold -= 1
            return 0, ""
        ceiling = min(self.maximum, self._cpu_ceiling(w))
        if w.wait_fraction > self.wait_high and self.workers < ceiling:
            # A step in proportion to the wait (at most doubling): the climb to many I/O-bound
            # workers takes a few trials, and a large step's gain stands out of the noise.
            step = max(1, min(round(self.workers * w.wait_fraction), self.workers,
                              ceiling - self.workers))
            self._last_move = step
            idle = "" if w.idle_cores is None else f", {w.idle_cores:.1f} cores idle"
            return step, f"consumer waits {100 * w.wait_fraction:.0f}%{idle}: trying {step} more"
        if w.wait_fraction < self.wait_low and self.workers > self.minimum:
            self._last_move = -1
            return -1, f"consumer never waits ({100 * w.wait_fraction:.1f}%)"
        return 0, ""

    def _cpu_ceiling(self, w: Window) -> int:
        """The most workers whose CPU demand fits the cores, from the share of time they sleep
        (unbounded where unknown). Beyond it a trial could only pay by taking the cores from
        other processes of a shared machine, which the verdict would take for a gain."""
        if w.worker_sleep is None or w.worker_sleep >= 1.0:
            return self.maximum
        return max(self.cores, int(self.cores / (1 - w.worker_sleep)))


# A window closes after this many batches or this many seconds (with at least _MIN_BATCHES),
# so that short epochs and the first seconds of a run are tuned too.
_WINDOW_BATCHES = 20
_WINDOW_S = 0.5
_MIN_BATCHES = 3


class TuningWindows:
    """Cuts a pool's deliveries into :class:`Window` s and feeds each to the tuner.

    A window's ``worker_sleep`` is the share of time the workers slept *while working on a
    task*: what they slept in all (:class:`WorkerSleepMeter`) less what they spent with no
    task to work on (from the wall time their tasks took). Workers idle for want of tasks (the
    main process is what limits the pace) sleep too, but on storage they do not wait.

    Args:
        tuner: decides the worker count.
        worker_tasks: the kernel tasks of the workers that take tasks, read now so that the
            first window is measured too.
        waited: the consumer's total wait so far, in seconds.
        worker_busy: the workers' total time on tasks so far, in seconds.
    """

    def __init__(self, tuner: WorkerTuner, worker_tasks: list[int], waited: float,
                 worker_busy: float) -> None:
        self.tuner = tuner
        self._cpu = CpuMeter()
        self._sleep = WorkerSleepMeter(worker_tasks)
        self._start, self._start_waited, self._start_busy = time.perf_counter(), waited, worker_busy
        self._batches = 0

    def delivered(self, waited: float, worker_tasks: list[int], worker_busy: float
                  ) -> int | None:
        """Count one delivered batch (``waited``, ``worker_busy``: the totals so far); when a
        window closes, return the worker count the tuner wants."""
        self._batches += 1
        now = time.perf_counter()
        elapsed = now - self._start
        long_enough = self._batches >= _MIN_BATCHES and elapsed >= _WINDOW_S
        if self._batches < _WINDOW_BATCHES and not long_enough:
            return None
        window_waited = waited - self._start_waited
        window_busy = worker_busy - self._start_busy
        batches, self._batches = self._batches, 0
        self._start, self._start_waited, self._start_busy = now, waited, worker_busy
        if elapsed <= 0:
            return None
        sleep = self._sleep.sleep_fraction(worker_tasks)
        if sleep is not None and worker_tasks:
            idle = max(0.0, 1 - window_busy / (elapsed * len(worker_tasks)))
            sleep = max(0.0, sleep - idle)
        return self.tuner.observe(Window(batches / elapsed, min(1.0, window_waited / elapsed),
                                         self._cpu.idle_cores(), sleep))
