"""From the window to the diagnosis: the step figures, the stages, the loader-alone runs, the
verdict and the recommendations.

Runs in the measuring process after the script has stopped. The loader-alone runs of the
options are made only when the loader can be the bottleneck: a loop that barely waits gets its
loader's ceiling measured, and if that leaves ample room, no option is measured or offered.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fastfeed._proc import available_cpus
from fastfeed.device import training_device
from fastfeed.doctor.candidates import configurations, workers_settle, yours
from fastfeed.doctor.findings import REPORT, Diagnosis, Option, Stage, Unmeasured
from fastfeed.doctor.loaders import LoaderSpec
from fastfeed.doctor.probe import LoaderTrace, Probe
from fastfeed.doctor.recommend import recommend
from fastfeed.doctor.settings import Settings
from fastfeed.doctor.stage_worker import profile_in_worker
from fastfeed.doctor.stages import COLLATE, StageCost, most_samples_per_s, profile_samples
from fastfeed.doctor.system import ProcessTree, usage_between
from fastfeed.doctor.trials import (
    BASELINE,
    Result,
    TrialPlan,
    made_rate,
    ready_ms,
    run_trials,
    settle_workers,
)
from fastfeed.doctor.verdict import judge
from fastfeed.gpu_sampler import GpuSampler
from fastfeed.nvml import GpuSample

__all__ = ["Captured", "Steps", "diagnose", "stages_ruled_out"]

# A loader measured this much faster than its stage times allow shows that something slowed
# the stages while they were timed: a margin beyond the few per cent between repeats.
RULED_OUT = 1.25


@dataclass
class Captured:
    """What was read from the script's loader and machine when its window closed."""

    trace: LoaderTrace
    spec: LoaderSpec
    start: ProcessTree
    end: ProcessTree
    seconds: float
    gpu: list[GpuSample]
    gpu_status: str


@dataclass(frozen=True)
class Steps:
    """The window's measured steps: seconds waiting and computing, and samples, per step."""

    waits: list[float]
    computes: list[float]
    samples: list[int]
    gpu_idle: list[float] | None  # per step, where CUDA events timed every step

    @classmethod
    def of(cls, trace: LoaderTrace, warmup: int) -> Steps:
        steps = range(warmup, len(trace.computes))
        # Steps another loader's batches ran in (a validation pass) say nothing of this one.
        chosen = [k for k in steps if trace.clean[k]] or list(steps)
        idle = trace.gpu.idle_s
        return cls([trace.waits[k] for k in chosen],
                   [max(0.0, trace.computes[k]) for k in chosen],
                   [trace.samples[k] for k in chosen],
                   [idle[k] for k in chosen] if chosen and all(k in idle for k in chosen)
                   else None)

    @property
    def total_s(self) -> float:
        return sum(self.waits) + sum(self.computes)

    @property
    def stall(self) -> float:
        waited = sum(self.gpu_idle) if self.gpu_idle is not None else sum(self.waits)
        return min(1.0, waited / self.total_s) if self.total_s > 0 else 0.0

    def rate(self, seconds: float) -> float | None:
        return sum(self.samples) / seconds if seconds > 0 else None


def _progress(message: str) -> None:
    print(f"fastfeed doctor: {message}", file=sys.stderr, flush=True)


def _device() -> torch.device | None:
    """The GPU the script trained on (:func:`~fastfeed.device.training_device`), if the script
    initialised CUDA."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return training_device()
    return None


def _transfer_ms(batch: Any, plan: TrialPlan) -> float:
    assert plan.device is not None
    times = []
    for _ in range(5):
        start = time.perf_counter()
        plan.consume(batch)
        torch.cuda.synchronize(plan.device)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def _loader(captured: Captured) -> dict[str, Any]:
    spec, dataset = captured.spec, captured.spec.dataset
    return {"class": captured.trace.name, "fastloader": spec.fast,
            "dataset": f"{type(dataset).__module__}.{type(dataset).__qualname__}",
            "batch_size": spec.batch_size, "num_workers": spec.workers,
            "pin_memory": spec.arguments["pin_memory"],
            "persistent_workers": spec.arguments["persistent_workers"],
            "batches_per_epoch": spec.length,
            **{name: repr(value) for name, value in spec.set_options().items()}}


def _measure_options(spec: LoaderSpec, stages: list[StageCost], plan: TrialPlan,
                     settings: Settings, startup_share: float | None, stall: float,
                     consumer: float) -> tuple[list[Result], list[Unmeasured]]:
    """The script's loader alone first when the loop barely waited, and the options only if
    the loader can be the bottleneck; ``num_workers="auto"`` is let settle before them."""
    if not judge(stall, consumer, None).loader_helps:
        _progress("the loop barely waited: measuring the loader's ceiling alone")
        ceiling = run_trials([yours(spec)], plan)
        if ceiling[0].error or not judge(stall, consumer, ceiling[0].samples_per_s).loader_helps:
            return ceiling, []
    settled, unsettled = None, []
    if workers_settle(spec):
        _progress(f'letting num_workers="auto" settle on your data (up to '
                  f"{settings.trial_seconds:g} s)")
        try:
            settled = settle_workers(plan)
        except Exception as error:  # as a failed run of an option: said, never fatal
            unsettled = [Unmeasured('num_workers="auto"',
                                    f"its run failed: {type(error).__name__}: {error}")]
    configs, unmeasured = configurations(spec, stages, plan.device, startup_share,
                                         settings.trial_batches, settled)
    unmeasured += unsettled
    _progress(f"measuring {len(configs)} loader configurations × {plan.repeats} repeats, "
              "alternated")
    return run_trials(configs, plan), unmeasured


def _describe_window(diagnosis: Diagnosis, captured: Captured, probe: Probe,
                     settings: Settings, steps: Steps) -> None:
    """The figures of the script's own run: stall, rates, its loader, the machine."""
    trace = captured.trace
    diagnosis.stall_fraction = steps.stall
    diagnosis.stall_source = "cuda events" if steps.gpu_idle is not None else "host"
    diagnosis.consumer_samples_per_s = steps.rate(steps.total_s) or 0.0
    diagnosis.model_samples_per_s = steps.rate(sum(steps.computes))
    if trace.first_iter_at is not None:
        diagnosis.time_to_first_batch_s = trace.delivered_at[0] - trace.first_iter_at
    diagnosis.loader = _loader(captured)
    diagnosis.other_loaders = [{"class": t.name, "batches": t.batches}
                               for t in probe.traces if t is not trace]
    diagnosis.window = {"warmup_batches": settings.warmup, "steps": len(steps.waits),
                        "seconds": steps.total_s, "batches": trace.batches,
                        "stopped": probe.closed and not settings.let_finish,
                        "script_ended": not probe.closed, "window_steps": settings.batches}
    diagnosis.timeline_ms = {"wait": [1000 * w for w in steps.waits],
                             "compute": [1000 * c for c in steps.computes]}
    usage = usage_between(captured.start, captured.end, captured.seconds)
    diagnosis.system = {"cpu_cores": available_cpus(), **asdict(usage),
                        "gpu": [asdict(g) for g in captured.gpu],
                        "gpu_status": captured.gpu_status}
    measured = len(trace.computes) - settings.warmup
    if len(steps.waits) < measured:
        diagnosis.notes.append(f"left out {measured - len(steps.waits)} steps in which "
                               "another loader delivered batches")


def _startup_share(diagnosis: Diagnosis, spec: LoaderSpec, steps: Steps) -> float | None:
    """Worker start-up's share of an epoch: what the first batch took beyond a step."""
    first = diagnosis.time_to_first_batch_s
    if first is None or not spec.length:
        return None
    step = statistics.median(w + c for w, c in zip(steps.waits, steps.computes, strict=True))
    startup = max(0.0, first - step)
    return startup / (startup + spec.length * step) if startup else None


def _profile(diagnosis: Diagnosis, spec: LoaderSpec, settings: Settings
             ) -> tuple[list[StageCost], Any]:
    collate_fn = spec.arguments.get("collate_fn")
    try:
        if spec.workers == 0:  # the main process does the work, with its own threads
            return profile_samples(spec.dataset, collate_fn, spec.batch_size,
                                   settings.profile_seconds, threads=None)
        return profile_in_worker(spec.dataset, collate_fn, spec.batch_size,
                                 settings.profile_seconds,
                                 spec.arguments.get("multiprocessing_context"),
                                 spec.arguments.get("worker_init_fn"))
    except Exception as error:  # the user's dataset, read again: report, never crash
        diagnosis.notes.append(f"per-sample stages not measured: {type(error).__name__}: "
                               f"{error}")
        return [], None


def stages_ruled_out(stages: list[StageCost], workers: int | str, rate: float | None) -> str:
    """Why the stage figures cannot be right, or ``""``: at their total cost a sample, the
    script's ``workers`` could not deliver the ``rate`` (samples/s) its loader was measured
    at. (``num_workers="auto"`` has no fixed count to bound the rate with.)"""
    if rate is None or not isinstance(workers, int):
        return ""
    allowed = most_samples_per_s(stages, workers)
    if allowed is None or rate <= RULED_OUT * allowed:
        return ""
    by = f"{workers} workers" if workers else "the main process"
    return (f"they add up to {sum(c.ms for c in stages):.2f} ms a sample, at which {by} could "
            f"deliver at most {allowed:,.0f} samples/s, but your loader delivered "
            f"{rate:,.0f}: something slowed the stages while they were timed that the "
            "loader's runs did not meet (other processes' work, files read for the first "
            "time). Run the doctor again when fewer other processes share the machine.")


def _per_batch(stages: list[StageCost], batch: Any, plan: TrialPlan) -> list[Stage]:
    per_batch = [Stage("collate", c.ms * (plan.spec.batch_size or 1), c.kind)
                 for c in stages if c.kind == COLLATE]
    ready = ready_ms(plan)
    if ready is not None:
        per_batch.append(Stage("main process (next() with a batch ready)", ready))
    if plan.device is not None and batch is not None:
        per_batch.append(Stage(f"transfer to {plan.device}", _transfer_ms(batch, plan)))
    return sorted(per_batch, key=lambda s: s.ms, reverse=True)


def _offer(diagnosis: Diagnosis, results: list[Result], unmeasured: list[Unmeasured],
           loader_helps: bool) -> None:
    """The options measured, the recommended ones, and what could not be measured; only the
    script's loader's ceiling when the loader is not the bottleneck."""
    options = [Option(r.change, r.speedup, r.same_batches, r.samples_per_s, r.key, r.note,
                      r.rates, r.gpu_work, r.gpu_ms_per_sample)
               for r in results if not r.error and (r.key == BASELINE or r.change)]
    failed = [Unmeasured(r.change or "your loader, rebuilt", f"its run failed: {r.error}")
              for r in results if r.error]
    if not loader_helps:
        diagnosis.measured = options[:1]
        return
    diagnosis.measured, diagnosis.recommendations = recommend(
        options, diagnosis.consumer_samples_per_s or 0.0, diagnosis.model_samples_per_s)
    diagnosis.unmeasured = unmeasured + failed


def diagnose(diagnosis: Diagnosis, captured: Captured, probe: Probe, settings: Settings
             ) -> Diagnosis:
    """Fill ``diagnosis`` from the closed window of ``captured``: the run's figures, the
    stages, the loader-alone runs, the verdict and what to change."""
    spec = captured.spec
    steps = Steps.of(captured.trace, settings.warmup)
    _describe_window(diagnosis, captured, probe, settings, steps)
    stall, consumer = steps.stall, diagnosis.consumer_samples_per_s or 0.0
    _progress(f"window closed after {len(steps.waits)} steps (training waited "
              f"{100 * stall:.0f}%); timing the dataset's stages")
    stages, batch = _profile(diagnosis, spec, settings)
    device = _device()
    gpu = GpuSampler(device.index) if device is not None else None
    plan = TrialPlan(spec, settings.trial_batches, settings.trial_seconds, settings.repeats,
                     device, gpu)
    if gpu is not None:
        gpu.start()
    try:
        results, unmeasured = _measure_options(spec, stages, plan, settings,
                                               _startup_share(diagnosis, spec, steps), stall,
                                               consumer)
    finally:
        if gpu is not None:
            gpu.stop()
    ceiling = None if results[0].error else results[0].samples_per_s
    verdict = judge(stall, consumer, ceiling)
    diagnosis.outcome = REPORT
    diagnosis.verdict, diagnosis.evidence = verdict.name, list(verdict.evidence)
    diagnosis.loader_ceiling_samples_per_s = ceiling
    # The rates the workers must have kept up inside each window, not what draining batches
    # they had prefetched before it looked like.
    prefetched = (spec.workers * (spec.arguments.get("prefetch_factor") or 0)
                  if isinstance(spec.workers, int) else 0)
    rates = [r for r in (None if results[0].error else results[0].made_per_s,
                         made_rate(consumer, len(steps.samples), prefetched)) if r]
    diagnosis.stages_ruled_out = stages_ruled_out(stages, spec.workers,
                                                  max(rates) if rates else None)
    if diagnosis.stages_ruled_out:
        stages = []
    diagnosis.per_sample_ms = [Stage(c.stage, c.ms, c.kind) for c in stages]
    diagnosis.per_batch_ms = _per_batch(stages, batch, plan)
    _offer(diagnosis, results, unmeasured, verdict.loader_helps)
    return diagnosis
