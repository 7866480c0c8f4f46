"""Where the time goes: the counters a loader keeps while it runs, which ``loader.stats()``
snapshots (:class:`~fastfeed.stats.LoaderStats`).

Per batch the loader records a handful of ``perf_counter`` readings (a few microseconds,
against milliseconds per batch); workers time their own fetch and collate steps and send the
figures with the batch. GPU utilisation and memory come from NVML
(:class:`~fastfeed.gpu_sampler.GpuSampler`): a background thread samples them twice a second
while a CUDA loader is iterating, and a window too short for it (an epoch of a few batches) is
read from the driver's own samples; without NVML, a reason.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fastfeed.gpu_sampler import GpuSampler
from fastfeed.protocol import Produced
from fastfeed.stats import LoaderStats

# GpuSampler and LoaderStats are read here too: their homes are gpu_sampler.py and stats.py.
__all__ = ["GpuSampler", "LoaderStats", "Telemetry", "batch_length"]

logger = logging.getLogger("fastfeed")

STAGES = ("fetch", "collate", "transfer", "gpu_transform")


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
        self.worker_mode = "process"  # the live pool iterator's backend (see serving)
        self.slot_pool: Any = None  # its slot pool, for occupancy
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

    def serving(self, worker_mode: str, slot_pool: Any) -> None:
        """A pool iterator starts: its workers' mode and its slot pool (None: none), which the
        stats describe from now on."""
        self.worker_mode, self.slot_pool = worker_mode, slot_pool

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
            slots_used=used,
            slots=allocated,
            slot_mb=(self.slot_pool.nbytes / 2**20) if self.slot_pool is not None else 0.0,
            skipped_samples=self.skipped,
            gpu=(gpu.reading(self.first_request, self.last_delivery)
                 if self.first_request is not None and self.last_delivery is not None else []),
            gpu_status=gpu.status,
            decisions=list(self.decisions),
        )
