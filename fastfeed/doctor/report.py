"""The terminal report: the verdict first, then where the time goes, then what to change.

Written for someone who has never profiled a loader: every figure says what it is, the verdict
says why, and a recommendation is one line to paste with the speed-up it measured here. When
the loader is not the bottleneck the report says so, and offers nothing.
"""

from __future__ import annotations

from typing import Any

from fastfeed.doctor.findings import Diagnosis, Option, Stage
from fastfeed.doctor.recommend import gpu_cost_outweighs
from fastfeed.doctor.system import CPU_BOUND, SATURATED
from fastfeed.doctor.verdict import COMPUTE_BOUND

__all__ = ["format_report"]

_BAR = 24  # characters of the largest stage's bar
_SHOWN = 8  # stages listed; the rest are summed on one line


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f} samples/s"


def _loader_line(d: Diagnosis) -> str:
    loader = d.loader
    epoch = loader.get("batches_per_epoch")
    return (f"  loader: {loader.get('class')} over {loader.get('dataset', '?').rsplit('.', 1)[-1]}"
            f", batch {loader.get('batch_size')}, {loader.get('num_workers')} workers"
            + (f", {epoch} batches per epoch" if epoch else ""))


def _header(d: Diagnosis) -> list[str]:
    window = d.window
    end = ("then stopped" if window.get("stopped") else
           f"until the script ended, after {window.get('batches')} batches: its run was "
           f"shorter than the window of {window.get('window_steps')} steps"
           if window.get("script_ended") else "then left to finish")
    lines = [f"fastfeed doctor: {' '.join([d.script, *d.argv])}", _loader_line(d),
             f"  watched {window.get('steps')} training steps after {window.get('warmup_batches')}"
             f" warm-up batches ({window.get('seconds', 0):.1f} s), {end}"]
    lines += [f"  also iterated: {o['class']} ({o['batches']} batches)" for o in d.other_loaders]
    return lines


def _verdict(d: Diagnosis) -> list[str]:
    assert d.verdict is not None and d.stall_fraction is not None
    source = " (GPU idle time, from CUDA events)" if d.stall_source == "cuda events" else ""
    lines = ["", f"{d.verdict.upper()}{source}"]
    lines += [f"  - {sentence}" for sentence in d.evidence]
    if d.loader_ceiling_samples_per_s is None:  # else the evidence gives it, beside the ceiling
        lines.append(f"  - training consumed {_rate(d.consumer_samples_per_s)}")
    lines.append(f"  - with its data for free, the model step would take "
                 f"{_rate(d.model_samples_per_s)}")
    if d.time_to_first_batch_s is not None:
        startup = " (worker start-up)" if d.loader.get("num_workers") != 0 else ""
        lines.append(f"  - the first batch took {d.time_to_first_batch_s:.2f} s{startup}")
    return lines


def _stages(title: str, stages: list[Stage], unit_total: bool) -> list[str]:
    if not stages:
        return []
    total = sum(s.ms for s in stages)
    top = stages[0].ms or 1.0
    lines = ["", title]
    width = max(len(s.stage) for s in stages[:_SHOWN])
    for s in stages[:_SHOWN]:
        bar = "█" * max(1, round(_BAR * s.ms / top)) if s.ms > 0 else ""
        share = f"  {100 * s.ms / total:3.0f}%" if unit_total and total > 0 else ""
        lines.append(f"  {s.stage.ljust(width)}  {s.ms:9.3f} ms{share}  {bar}")
    rest = stages[_SHOWN:]
    if rest:
        lines.append(f"  ({len(rest)} more stages, {sum(s.ms for s in rest):.3f} ms together)")
    return lines


def _others(s: dict[str, Any]) -> float:
    """Cores in use by processes outside this training (machine_cores_used is known)."""
    return max(0.0, s["machine_cores_used"] - (s.get("cores_used") or 0.0))


def _all_busy(s: dict[str, Any]) -> bool:
    machine, cores = s.get("machine_cores_used"), s.get("cpu_cores")
    return machine is not None and cores is not None and cores > 0 and (
        machine >= SATURATED * cores)


def _cores(s: dict[str, Any]) -> str:
    """The cores, what this training used of them, and what the machine did besides."""
    line = f"{s.get('cpu_cores')} CPU cores"
    ours, machine = s.get("cores_used"), s.get("machine_cores_used")
    if machine is not None and ours is not None:
        full = ": all busy" if _all_busy(s) else ""
        return (line + f", {machine:.1f} in use ({ours:.1f} by this training, "
                f"{_others(s):.1f} by other processes{full})")
    return line + (f", {ours:.1f} in use by this training" if ours is not None else "")


def _system(d: Diagnosis) -> list[str]:
    s = d.system
    parts = [_cores(s)]
    if s.get("worker_processes"):
        busy, waiting = s.get("worker_busy"), s.get("worker_waiting")
        parts.append(f"{s['worker_processes']} child processes (workers)"
                     + (f" {100 * busy:.0f}% on a CPU" if busy is not None else "")
                     + (f", {100 * waiting:.0f}% waiting for one" if waiting is not None
                        else ""))
    if s.get("main_memory_mb") is not None:
        workers = s.get("workers_memory_mb")
        parts.append(f"memory {s['main_memory_mb']:,.0f} MB main process"
                     + (f", {workers:,.0f} MB workers" if workers else "") + " (PSS)")
    gpus = s.get("gpu") or []
    parts.append(", ".join(f"GPU {g['name']} {g['utilization']:.0f}% busy (NVML)" for g in gpus)
                 if gpus else f"GPU utilisation: n/a ({s.get('gpu_status')})")
    return ["", "Machine: " + "; ".join(parts), *_saturated(s)]


def _saturated(s: dict[str, Any]) -> list[str]:
    """What CPU-bound workers on all-busy cores mean: they wait for a core, not for work,
    however low their own share of CPU reads."""
    busy, waiting = s.get("worker_busy"), s.get("worker_waiting")
    if not _all_busy(s) or busy is None or waiting is None or busy + waiting < CPU_BOUND:
        return []
    return [f"  The workers are CPU-bound on cores that were all in use ({_others(s):.1f} of them "
            f"by other processes): they waited for a core {100 * waiting:.0f}% of the time. "
            "More workers would share the same cores; less CPU work per sample (the stages "
            "above), or fewer other processes, would help."]


def _same(option: Option) -> str:
    return {True: "same batches", False: "batches differ", None: "same batches: unknown"}[
        option.same_batches]


def _options(d: Diagnosis) -> list[str]:
    if d.verdict == COMPUTE_BOUND:
        return ["", "Nothing to change in the loader: it is not what training waits for."]
    lines = ["", "What to change (each measured in this run on your data: the loader alone, "
             "medians of alternated runs)"]
    options = sorted(d.measured[1:], key=lambda o: o.speedup, reverse=True)
    recommended = {o.key for o in d.recommendations}
    width = max((len(o.change) for o in options), default=0)
    for o in options:
        note = f"; {o.note}" if o.note else ""
        gain = ("" if o.key in recommended else
                "  (not recommended: the GPU time it takes from the model step outweighs it)"
                if gpu_cost_outweighs(o) else "  (no gain measured)")
        lines.append(f"  {o.speedup:5.2f}×  {o.change.ljust(width)}  {_same(o)}{note}{gain}")
    if not options:
        lines.append("  (no fastfeed option applies to this loader)")
    if d.measured:
        lines.append(f"  (your loader alone: {_rate(d.measured[0].samples_per_s)})")
    if not d.recommendations and d.per_sample_ms:
        top = d.per_sample_ms[0]
        lines.append(f"  None measured faster. The largest cost is {top.stage} "
                     f"({top.ms:.2f} ms per sample): that is the place to look.")
    if d.unmeasured:
        lines += ["", "Not measured here"]
        lines += [f"  - {u.change}: {u.reason}" for u in d.unmeasured]
    return lines


def format_report(d: Diagnosis) -> str:
    """The report of a diagnosis with outcome ``"report"``."""
    lines = _header(d) + _verdict(d)
    title = "Where a sample's time goes (ms per sample, exclusive; as a worker runs it)"
    if d.stages_ruled_out:
        lines += ["", title, f"  Not shown: {d.stages_ruled_out}"]
    lines += _stages(title, d.per_sample_ms, unit_total=True)
    lines += _stages("Per batch (ms)", d.per_batch_ms, unit_total=False)
    lines += _system(d) + _options(d)
    lines += [f"Note: {note}" for note in d.notes]
    return "\n".join(lines)
