"""Loader-alone runs: each configuration's samples/s on the script's own data.

Each configuration is a loader built fresh from the script's (:class:`~fastfeed.doctor.loaders.
LoaderSpec`), iterated with no model: a warm-up (worker start-up and the batches the workers
prefetch), then about ``batches`` timed batches, in whole rounds of the workers and within the
first epoch where it is long enough, or ``seconds``: the loader's steady pace, as training sees
it between epochs. Persistent workers change what happens *at* an epoch's start, so they are
timed over whole epochs, against the script's loader timed the same way. Configurations
alternate, in reversed order every other repeat, so that drift on a busy machine spreads over
all of them, and medians of the repeats are compared.

Every run starts from the same random state and fingerprints every batch it delivers
(:mod:`~fastfeed.doctor.fingerprint`): a configuration keeps the batches when its fingerprints
equal the script's loader's; when they differ, the answer is "no" only if the script's loader
gave the same batches in every repeat (else the pipeline draws randomness a seed does not fix,
and the doctor cannot tell).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
import warnings
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from fastfeed.doctor.fingerprint import fingerprint, resolve
from fastfeed.doctor.loaders import LoaderSpec
from fastfeed.gpu_sampler import GpuSampler
from fastfeed.loader import FastLoader
from fastfeed.progress import progress
from fastfeed.telemetry import batch_length
from fastfeed.tree import map_tensors

__all__ = ["BASELINE", "Config", "Result", "TrialPlan", "ready_ms", "run_trials",
           "settle_workers"]

BASELINE = "yours"  # the key of the script's own loader
# Prefetched batches a run warms up with, at most, however many the workers prefetch.
_MAX_WARMUP = 16


@dataclass
class Config:
    """One way to load the script's data.

    Attributes:
        key: a short name (``"swap"``, ``"auto"``, ...); the script's own loader is
            :data:`BASELINE`.
        change: the line a user pastes to get it; empty for the script's own loader.
        build: makes a fresh loader.
        context: entered around building and iterating (a patch, say).
        note: said with the result.
        epochs: time whole epochs, their start included, after a first one (what persistent
            workers change); by default a run times the steady pace within the first epoch.
        against: the key of the configuration its speed-up is measured against.
        gpu_work: it runs work of its own on the GPU (decode, augmentation), which training's
            model step would share: its GPU time per sample is measured.
    """

    key: str
    change: str
    build: Callable[[], DataLoader]
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    note: str = ""
    epochs: bool = False
    against: str = BASELINE
    gpu_work: bool = False


@dataclass
class _Run:
    rate: float
    made_rate: float  # made_rate(rate, ...): what the workers must have made in the window
    fingerprints: list[tuple[Any, ...]]
    ready_ms: list[float]
    gpu_s_per_sample: float | None = None


@dataclass
class Result:
    """A configuration's median samples/s, its speed-up over the script's loader, and whether
    it gave the same batches (``None``: the doctor cannot tell); ``error`` when a run failed."""

    key: str
    change: str
    samples_per_s: float
    rates: list[float]
    speedup: float
    same_batches: bool | None
    note: str = ""
    error: str = ""
    gpu_work: bool = False
    gpu_ms_per_sample: float | None = None  # GPU time beyond the configuration it is against
    made_per_s: float = 0.0  # the median of its runs' made_rate


@dataclass(frozen=True)
class _Shape:
    """A run's warm-up and timed batches. Workers deliver in rounds (torch's order is
    round-robin), so a run times whole ``rounds``: where it starts within a round does not
    bias its rate. ``prefetched``: the batches its workers fetch ahead."""

    warmup: int
    timed: int
    rounds: int
    prefetched: int


@dataclass
class TrialPlan:
    """How long each run lasts, and what the script did with a batch (``to(device)``).

    Each run warms up with its first batch and the batches its workers prefetch (at least
    one); the script's loader's runs time the ``next()`` of those once the workers have had
    time to prepare them (:func:`ready_ms`).
    """

    spec: LoaderSpec
    batches: int = 30
    seconds: float = 10.0
    repeats: int = 3
    device: torch.device | None = None
    gpu: GpuSampler | None = None  # the device's utilisation: what the GPU options cost it
    results: dict[str, list[_Run]] = field(default_factory=dict)

    def shape(self, config: Config, loader: DataLoader) -> _Shape:
        """How a run of ``config`` goes, given its loader: whole rounds within the first epoch
        where it is long enough; a first epoch, then two, in ``epochs`` mode or when epochs
        are too short to hold a warm-up and a round (their starts then count)."""
        workers = loader.num_workers
        rounds = max(1, workers)
        prefetched = workers * (loader.prefetch_factor or 0) if workers else 0
        warmup = 1 + min(_MAX_WARMUP, max(1, prefetched))
        length = self.spec.length
        if config.epochs or (length is not None and length < warmup + rounds):
            assert length is not None, "epochs mode needs a loader that ends its epochs"
            return _Shape(length, 2 * length, rounds, prefetched)
        timed = max(1, round(self.batches / rounds))
        if length is not None:
            timed = max(1, min(timed, (length - warmup) // rounds))
        return _Shape(warmup, timed * rounds, rounds, prefetched)

    def gpu_s(self, since: float, until: float) -> float | None:
        """Seconds the GPU was busy between two ``time.perf_counter()`` times (NVML's share
        of time a kernel ran); ``None`` without a GPU or NVML."""
        reading = self.gpu.reading(since, until) if self.gpu is not None else []
        return reading[0].utilization / 100 * (until - since) if reading else None

    def consume(self, batch: Any) -> Any:
        device = self.device
        if device is None:
            return batch
        return map_tensors(lambda t: t.to(device, non_blocking=True), batch)


def made_rate(rate: float, batches: int, prefetched: int) -> float:
    """The share of ``rate``, measured over a window of ``batches``, that the workers must
    have made inside the window: up to ``prefetched`` batches may have been ready when it
    opened (a main process that lost its core for a moment, on a busy machine, finds them
    all ready), and a window of no more batches than that bounds nothing."""
    return rate * max(0, batches - prefetched) / batches if batches > 0 else 0.0


def _endless(loader: DataLoader) -> Generator[Any, None, None]:
    """Batches epoch after epoch: a new epoch's start-up counts, as it does in training."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise RuntimeError("the loader yielded no batches")


def _warm_up(batches: Iterator[Any], plan: TrialPlan, shape: _Shape, ready: bool
             ) -> tuple[list[list[Any]], list[float]]:
    """The first batch (worker start-up), then the batches the workers prefetch: their
    fingerprints and, with ``ready``, how long ``next()`` took for each of them after a pause
    long enough for the workers to have them ready: the main process's own cost of a batch
    (receiving and rebuilding it)."""
    asked = time.perf_counter()
    prints = [fingerprint(plan.consume(next(batches)))]
    if ready:
        # The first batch took about one batch's work (and the start-up): each worker has
        # prefetched/rounds batches to make.
        first = time.perf_counter() - asked
        time.sleep(min(1.0, 2 * first * shape.prefetched / shape.rounds))
    ready_ms = []
    for _ in range(shape.warmup - 1):
        asked = time.perf_counter()
        prints.append(fingerprint(plan.consume(next(batches))))
        ready_ms.append(1000 * (time.perf_counter() - asked))
    return prints, ready_ms if ready else []


def _run_once(config: Config, plan: TrialPlan) -> _Run:
    plan.spec.reset_random()
    auto_collation = plan.spec.batch_size is not None
    # The doctor's own loaders: torch's warning that more workers than cores may be slow is
    # what the runs measure, not news to the user.
    with config.context(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loader = config.build()
        batches = _endless(loader)
        try:
            shape = plan.shape(config, loader)
            prints, ready = _warm_up(batches, plan, shape,
                                     config.key == BASELINE and shape.prefetched > 0)
            samples = count = 0
            start = time.perf_counter()  # the last warm-up batch has just arrived
            for count in range(1, shape.timed + 1):
                batch = plan.consume(next(batches))
                prints.append(fingerprint(batch))
                samples += batch_length(batch, auto_collation)
                if (not config.epochs and count % shape.rounds == 0
                        and time.perf_counter() - start > plan.seconds):
                    break
            if plan.device is not None and plan.device.type == "cuda":
                torch.cuda.synchronize(plan.device)
            end = time.perf_counter()
        finally:
            batches.close()  # ends the epoch's iterator: its workers stop
            del batches, loader
            gc.collect()
    gpu_s = plan.gpu_s(start, end)
    rate = samples / (end - start)
    return _Run(rate, made_rate(rate, count, shape.prefetched), resolve(prints), ready,
                gpu_s / samples if gpu_s is not None and samples else None)


def _same(runs: list[_Run], baseline: list[_Run]) -> bool | None:
    reference = baseline[0].fingerprints
    if all(run.fingerprints[:len(reference)] == reference[:len(run.fingerprints)]
           for run in runs):
        return True
    reproducible = len(baseline) > 1 and all(
        run.fingerprints[:len(reference)] == reference[:len(run.fingerprints)]
        for run in baseline[1:])
    return False if reproducible else None


def _extra_gpu_ms(runs: list[_Run], against: list[_Run]) -> float | None:
    """Milliseconds of GPU time per sample beyond the configuration it is compared with
    (medians of the runs; its copies to the GPU, say, the script's loader makes too)."""
    mine = [r.gpu_s_per_sample for r in runs if r.gpu_s_per_sample is not None]
    theirs = [r.gpu_s_per_sample for r in against if r.gpu_s_per_sample is not None]
    if not mine or not theirs:
        return None
    return 1000 * max(0.0, statistics.median(mine) - statistics.median(theirs))


def run_trials(configs: list[Config], plan: TrialPlan, desc: str = "fastfeed doctor"
               ) -> list[Result]:
    """Run every configuration ``plan.repeats`` times, alternated, and compare each with the
    configuration it names (the script's own loader, by default). Results in the order of
    ``configs``."""
    runs: dict[str, list[_Run]] = {config.key: [] for config in configs}
    errors: dict[str, str] = {}
    schedule = [c for r in range(plan.repeats) for c in (configs if r % 2 == 0 else configs[::-1])]
    for config in progress(schedule, total=len(schedule), desc=f"{desc}: loader-alone runs"):
        if config.key in errors:
            continue
        try:
            runs[config.key].append(_run_once(config, plan))
        except Exception as error:  # one option failing must not cost the others
            errors[config.key] = f"{type(error).__name__}: {error}"
    plan.results.update(runs)
    rates = {key: statistics.median(run.rate for run in done) for key, done in runs.items()
             if done}
    results = []
    for config in configs:
        if config.key in errors:
            results.append(Result(config.key, config.change, 0.0, [], 0.0, None, config.note,
                                  errors[config.key]))
            continue
        done, against = runs[config.key], runs.get(config.against, [])
        base = rates.get(config.against, 0.0)
        results.append(Result(config.key, config.change, rates[config.key],
                              [run.rate for run in done],
                              rates[config.key] / base if base else 0.0,
                              _same(done, against) if against else None, config.note,
                              gpu_work=config.gpu_work,
                              gpu_ms_per_sample=_extra_gpu_ms(done, against)
                              if config.gpu_work else None,
                              made_per_s=statistics.median(run.made_rate for run in done)))
    return results


def settle_workers(plan: TrialPlan) -> int:
    """The worker count ``num_workers="auto"`` settles on over the script's data: a FastLoader
    with it, iterated (untimed) for ``plan.seconds`` or four times ``plan.batches``."""
    plan.spec.reset_random()
    loader = plan.spec.build(fast=True, num_workers="auto")
    assert isinstance(loader, FastLoader)
    batches = _endless(loader)
    try:
        deadline = time.perf_counter() + plan.seconds
        for _ in range(4 * plan.batches):
            plan.consume(next(batches))
            if time.perf_counter() > deadline:
                break
        return loader.stats().workers
    finally:
        batches.close()
        del batches
        gc.collect()


def ready_ms(plan: TrialPlan) -> float | None:
    """The script's loader's ``next()`` time for a batch its workers had ready: the median of
    the faster half of those timed (a batch that was not ready after all only lengthens the
    slower half)."""
    times = sorted(t for run in plan.results.get(BASELINE, []) for t in run.ready_ms)
    return statistics.median(times[:max(1, len(times) // 2)]) if times else None
