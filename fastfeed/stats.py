"""What ``loader.stats()`` returns, and how it reads: one line, a tqdm postfix, a report."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastfeed.nvml import GpuSample

__all__ = ["LoaderStats"]


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of a loader's telemetry since it was created (or last reset).

    Attributes:
        batches, samples: delivered to the consumer.
        elapsed_s: wall time from the first request for a batch to the latest delivery: the
            workers' start-up before the first request and the consumer's step after the last
            batch are outside it, so a stopwatch around a short epoch reads a lower rate.
        wait_fraction: share of ``elapsed_s`` the consumer spent waiting in ``__next__``
            (the data stall), in [0, 1].
        stage_ms: mean milliseconds per batch of each stage: ``fetch`` (dataset reads) and
            ``collate`` (in the workers), ``transfer`` (host-to-device enqueue) and
            ``gpu_transform`` (the host side of launching it).
        workers: current worker count; ``worker_mode``: ``"process"``, ``"thread"`` or
            ``"ray"`` (``"main process"`` without workers).
        worker_utilization: share of the workers' wall time spent fetching and collating.
        slots_used, slots, slot_mb: the slot pool now: slots in use, slots made, their
            megabytes (the pool grows as tasks need slots, up to its budget: ``slots`` may be
            below the loader's ``ring_slots``). ``ring_slots_used``, ``ring_slots`` and
            ``ring_mb`` are their former names, still read.
        skipped_samples: samples dropped by an ``on_error="skip"`` policy.
        gpu: NVML's reading of this loader's GPU over ``elapsed_s`` (mean utilisation, peak
            memory); empty before a batch, or without NVML.
        gpu_status: why ``gpu`` is empty, or ``"ok"``.
        decisions: the worker tuner's decisions, oldest first.
    """

    batches: int
    samples: int
    elapsed_s: float
    wait_fraction: float
    stage_ms: dict[str, float]
    workers: int
    worker_mode: str
    worker_utilization: float
    slots_used: int
    slots: int
    slot_mb: float
    skipped_samples: int
    gpu: list[GpuSample]
    gpu_status: str
    decisions: list[str] = field(default_factory=list)

    @property
    def ring_slots_used(self) -> int:
        return self.slots_used

    @property
    def ring_slots(self) -> int:
        return self.slots

    @property
    def ring_mb(self) -> float:
        return self.slot_mb

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> str:
        """One line: throughput, stall, workers, slots in use, GPU."""
        gpu = (", ".join(f"gpu{g.index} {g.utilization:.0f}%" for g in self.gpu)
               if self.gpu else "gpu n/a")
        return (f"{self.samples_per_s:,.0f} samples/s, {self.batches_per_s:.1f} batches/s, "
                f"stall {100 * self.wait_fraction:.1f}%, {self.workers} {self.worker_mode} "
                f"workers ({100 * self.worker_utilization:.0f}% busy), slots "
                f"{self.slots_used}/{self.slots}, {gpu}")

    def postfix(self) -> dict[str, str]:
        """Short fields for ``tqdm.set_postfix``."""
        return {"img/s": f"{self.samples_per_s:,.0f}", "stall": f"{100 * self.wait_fraction:.0f}%",
                "workers": str(self.workers)}

    def __str__(self) -> str:
        stages = "  ".join(f"{name} {ms:.2f}" for name, ms in self.stage_ms.items())
        lines = [
            f"batches {self.batches}, samples {self.samples} in {self.elapsed_s:.2f} s "
            f"(first request to last batch): {self.samples_per_s:,.1f} samples/s, "
            f"{self.batches_per_s:.2f} batches/s",
            f"data stall: {100 * self.wait_fraction:.1f}% of wall time waiting in __next__",
            f"per batch (ms): {stages}",
            f"workers: {self.workers} ({self.worker_mode}), "
            f"{100 * self.worker_utilization:.0f}% busy",
            f"slots: {self.slots_used}/{self.slots} slots in use, {self.slot_mb:.1f} MB",
            f"skipped samples: {self.skipped_samples}",
        ]
        if self.gpu:
            lines += [f"gpu{g.index} {g.name}: {g.utilization:.0f}% busy, "
                      f"{g.memory_used / 2**30:.1f}/{g.memory_total / 2**30:.1f} GiB"
                      for g in self.gpu]
        else:
            lines.append(f"gpu: {self.gpu_status}")
        lines += [f"tuner: {d}" for d in self.decisions]
        return "\n".join(lines)
