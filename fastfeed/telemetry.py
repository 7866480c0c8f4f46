"""Where the time goes: counters a loader keeps while it runs, and ``loader.stats()``.

Per batch the loader records a handful of ``perf_counter`` readings (a few microseconds,
against milliseconds per batch); workers time their own fetch and collate steps and send the
figures with the batch. GPU utilisation and memory come from NVML: a background thread samples
them twice a second while a CUDA loader is iterating, and a window too short for it (an epoch
of a few batches) is read from the driver's own samples; without NVML, a reason.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fastfeed.nvml import GpuSample, nvml_handle, nvml_status, sample_gpu, utilization_samples
from fastfeed.placement import nvml_device_for
from fastfeed.protocol import Produced

__all__ = ["GpuSampler", "LoaderStats", "Telemetry", "batch_length"]

logger = logging.getLogger("fastfeed")

STAGES = ("fetch", "collate", "transfer", "gpu_transform")


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
        workers: current worker count; ``worker_mode``: ``"process"`` or ``"thread"``.
        worker_utilization: share of the workers' wall time spent fetching and collating.
        ring_slots_used, ring_slots, ring_mb: ring occupancy now (the slot pool grows as tasks need
            slots, up to its budget: ``ring_slots`` may be below the loader's ``ring_slots``).
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
    ring_slots_used: int
    ring_slots: int
    ring_mb: float
    skipped_samples: int
    gpu: list[GpuSample]
    gpu_status: str
    decisions: list[str] = field(default_factory=list)

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
                f"{self.ring_slots_used}/{self.ring_slots}, {gpu}")

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
            f"slots: {self.ring_slots_used}/{self.ring_slots} slots in use, {self.ring_mb:.1f} MB",
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


class GpuSampler:
    """Samples this process's GPU through NVML on a daemon thread, and reads it for a span of
    time.

    Only the GPU the loader feeds is read: under DDP every rank runs a sampler, and each one
    reading every GPU of the node would multiply NVML queries by the rank count and report
    other ranks' GPUs as this loader's.

    A span the thread has samples of is read from them, without an NVML call; a shorter one
    (an epoch of a few batches, or a sampler never started) from the driver's own samples of
    that span, else from one reading when asked: a span in which the GPU was read always
    gets a figure.

    Args:
        cuda_index: the CUDA device (this process's numbering) the batches go to; ``None``:
            torch's current device (``torch.cuda.set_device``), without initialising CUDA.
        interval: seconds between readings.
    """

    def __init__(self, cuda_index: int | None = None, interval: float = 0.5) -> None:
        self.interval = interval
        self._samples: list[tuple[float, GpuSample]] = []  # (time.perf_counter(), reading)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started: float | None = None
        self._handle: object = None
        status = nvml_status()
        self.status = "ok" if status.available else status.reason
        if status.available:
            if cuda_index is None:
                cuda_index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
            try:
                self._handle = nvml_handle(nvml_device_for(
                    cuda_index, os.environ.get("CUDA_VISIBLE_DEVICES")))
            except Exception as error:  # an unknown UUID, or NVML's own errors
                self.status = f"{type(error).__name__}: {error}"

    def start(self) -> None:
        if self.status != "ok" or (self._thread is not None and self._thread.is_alive()):
            return
        self._started = time.perf_counter()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="fastfeed-nvml", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._samples.append((time.perf_counter(), sample_gpu(self._handle)))
            except Exception as error:  # NVML can fail mid-run (driver reset): stop quietly
                self.status = f"{type(error).__name__}: {error}"
                return
            del self._samples[:-600]  # the last five minutes at the default interval

    def average(self) -> list[GpuSample]:
        """:meth:`reading` since :meth:`start` (a sampler never started: at this moment)."""
        return self.reading(self._started if self._started is not None else time.perf_counter())

    def reading(self, since: float, until: float | None = None) -> list[GpuSample]:
        """The GPU's mean utilisation and peak memory between two ``time.perf_counter()``
        times (``until``: now): one entry, or none where NVML cannot be read."""
        until = time.perf_counter() if until is None else until
        ours = [sample for at, sample in list(self._samples) if since <= at <= until]
        if ours:
            last = ours[-1]
            return [GpuSample(last.index, last.name,
                              sum(r.utilization for r in ours) / len(ours),
                              max(r.memory_used for r in ours), last.memory_total)]
        if self._handle is None:
            return []
        try:
            now = sample_gpu(self._handle)
        except Exception as error:  # as in the thread: a reason, never an exception
            self.status = f"{type(error).__name__}: {error}"
            return []
        busy = self._driver_utilization(since, until)
        return [GpuSample(now.index, now.name, now.utilization if busy is None else busy,
                          now.memory_used, now.memory_total)]

    @staticmethod
    def _wall_us(perf: float) -> int:
        """A ``time.perf_counter()`` time on the driver's clock (microseconds since the epoch)."""
        return int(1e6 * (time.time() - (time.perf_counter() - perf)))

    def _driver_utilization(self, since: float, until: float) -> float | None:
        """The mean of the driver's samples within the span, or of the first one after it
        (whose period holds the span's end); ``None`` where it has none."""
        try:
            samples = utilization_samples(self._handle, self._wall_us(since))
        except Exception:  # not kept on this GPU, or none that recent: read it now instead
            return None
        end = self._wall_us(until)
        within = [busy for at, busy in samples if at <= end] or [busy for _, busy in samples[:1]]
        return sum(within) / len(within) if within else None


def batch_length(batch: Any, auto_collation: bool) -> int:
    """Samples in a batch: the leading size of its largest tensor (1 without auto-collation).

    The largest, not the first: a detection batch often leads with per-box tensors (Ultralytics
    sorts its keys, so ``batch_idx`` comes before ``img``). A batch without tensors counts the
    first list of plain values (file names, say).
    """
    if not auto_collation:
        return 1
    largest: torch.Tensor | None = None
    values: int | None = None
    stack = [batch]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            if largest is None or item.numel() > largest.numel():
                largest = item
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            if item and not isinstance(item[0], (torch.Tensor, Mapping, list, tuple)):
                values = len(item) if values is None else values
            else:
                stack.extend(item)
    if largest is not None:
        return int(largest.shape[0]) if largest.dim() else 1
    return values if values is not None else 1


class Telemetry:
    """Accumulates a loader's counters, across epochs, until :meth:`reset`.

    The training thread records deliveries; the device stage's helper threads (the pinned
    copies', the blocking transforms') record the stages they run and the batches they pull,
    so every update takes a lock (uncontended, well under a microsecond).

    ``describe`` renders the one-line summary logged every ``log_every`` batches.
    """

    def __init__(self, log_every: int | None = None,
                 describe: Callable[[], str] | None = None) -> None:
        self.log_every = log_every
        self.describe = describe
        self.worker_mode = "process"
        self.slot_pool: Any = None  # the live iterator's SlotPool, for occupancy
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        self.batches = 0
        self.samples = 0
        self.waited = 0.0
        self.first_request: float | None = None
        self.last_delivery: float | None = None
        self.stage_s = dict.fromkeys(STAGES, 0.0)
        self.stage_batches = dict.fromkeys(STAGES, 0)
        self.worker_busy_s = 0.0
        self.skipped = 0
        self.decisions: list[str] = []

    def add_stage(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._add_stage_locked(stage, seconds)

    def _add_stage_locked(self, stage: str, seconds: float) -> None:
        self.stage_s[stage] += seconds
        self.stage_batches[stage] += 1

    def record_produced(self, produced: Produced, by_worker: bool = True) -> None:
        """A worker's (or the main process's) timings and skips for one batch."""
        with self._lock:
            self.skipped += produced.skipped
            self._add_stage_locked("fetch", produced.fetch_s)
            self._add_stage_locked("collate", produced.collate_s)
            if by_worker:
                self.worker_busy_s += produced.fetch_s + produced.collate_s

    def delivered(self, requested_at: float, batch_size: int) -> None:
        now = time.perf_counter()
        with self._lock:
            if self.first_request is None:
                self.first_request = requested_at
            self.waited += now - requested_at
            self.last_delivery = now
            self.batches += 1
            self.samples += batch_size
            every = self.log_every
            log = every is not None and every > 0 and self.batches % every == 0
        if log:
            self._log_line()

    def decision(self, message: str) -> None:
        with self._lock:
            self.decisions.append(message)
        logger.debug("fastfeed tuner: %s", message)

    def _log_line(self) -> None:
        if self.describe is None:
            return
        if logging.getLogger().hasHandlers():
            logger.info(self.describe())  # the record names its logger, "fastfeed"
        else:
            print(f"fastfeed: {self.describe()}", file=sys.stderr, flush=True)

    @property
    def elapsed(self) -> float:
        if self.first_request is None or self.last_delivery is None:
            return 0.0
        return self.last_delivery - self.first_request

    def snapshot(self, workers: int, gpu: GpuSampler) -> LoaderStats:
        """The counters as :class:`LoaderStats`, for a loader with ``workers`` workers."""
        elapsed = self.elapsed
        used, allocated = self.slot_pool.occupancy if self.slot_pool is not None else (0, 0)
        return LoaderStats(
            batches=self.batches,
            samples=self.samples,
            elapsed_s=elapsed,
            wait_fraction=min(1.0, self.waited / elapsed) if elapsed > 0 else 0.0,
            stage_ms={stage: 1000 * self.stage_s[stage] / self.stage_batches[stage]
                      if self.stage_batches[stage] else 0.0 for stage in self.stage_s},
            workers=workers,
            worker_mode=self.worker_mode if workers else "main process",
            worker_utilization=min(1.0, self.worker_busy_s / (elapsed * workers))
            if elapsed > 0 and workers else 0.0,
            ring_slots_used=used,
            ring_slots=allocated,
            ring_mb=(self.slot_pool.nbytes / 2**20) if self.slot_pool is not None else 0.0,
            skipped_samples=self.skipped,
            gpu=(gpu.reading(self.first_request, self.last_delivery)
                 if self.first_request is not None and self.last_delivery is not None else []),
            gpu_status=gpu.status,
            decisions=list(self.decisions),
        )
