"""NVML's reading of the GPU a loader feeds: a sampler thread, and the figure for a span."""

from __future__ import annotations

import os
import threading
import time

import torch

from fastfeed.nvml import GpuSample, nvml_handle, nvml_status, sample_gpu, utilization_samples
from fastfeed.which_gpu import nvml_device_for

__all__ = ["GpuSampler"]


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

    def since_start(self) -> list[GpuSample]:
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
