"""GPU utilisation for a span of time (fastfeed/telemetry.py's ``GpuSampler.reading``), with a
stand-in NVML: a span shorter than the sampling thread's period (a short epoch) still gets a
reading, from the driver's own samples of that span or from one reading when asked; without
NVML, a reason and no reading, never an exception. On a GPU, a short epoch of a CUDA loader
has its reading in ``stats().gpu``.
"""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch

from fastfeed import FastLoader
from fastfeed.telemetry import GpuSampler


class NotFound(Exception):
    """pynvml's NVMLError_NotFound: no samples as recent as asked."""


def fake_pynvml(now_busy: float = 7.0) -> types.ModuleType:
    """One GPU; ``module.samples`` are the driver's ``(wall-clock µs, percent)`` samples,
    ``module.calls`` counts the readings asked of it."""
    module = types.ModuleType("pynvml")
    module.samples = []
    module.calls = 0
    module.NVML_GPU_UTILIZATION_SAMPLES = 1

    def utilization(handle):
        module.calls += 1
        return types.SimpleNamespace(gpu=now_busy)

    def samples(handle, kind, since_us):
        assert kind == module.NVML_GPU_UTILIZATION_SAMPLES
        found = [types.SimpleNamespace(timeStamp=at, sampleValue=types.SimpleNamespace(uiVal=v))
                 for at, v in module.samples if at > since_us]
        if not found:
            raise NotFound("Not Found")
        return 1, found

    module.nvmlInit = lambda: None
    module.nvmlSystemGetDriverVersion = lambda: "555.0"
    module.nvmlDeviceGetCount = lambda: 1
    module.nvmlDeviceGetHandleByIndex = lambda index: index
    module.nvmlDeviceGetIndex = lambda handle: handle
    module.nvmlDeviceGetName = lambda handle: "Stand-in GPU"
    module.nvmlDeviceGetUtilizationRates = utilization
    module.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=5, total=99)
    module.nvmlDeviceGetSamples = samples
    return module


def wall_us(perf: float) -> int:
    return int(1e6 * (time.time() - (time.perf_counter() - perf)))


@pytest.fixture
def nvml(monkeypatch):
    module = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return module


def test_a_span_shorter_than_the_thread_period_reads_the_driver_samples(nvml):
    sampler = GpuSampler(0, interval=600.0)  # the thread will not sample within the test
    sampler.start()
    since = time.perf_counter()
    time.sleep(0.02)
    until = time.perf_counter()
    sampler.stop()
    before, inside, after = wall_us(since) - 1000, wall_us(since) + 1000, wall_us(until) + 1000
    nvml.samples = [(before, 90.0), (inside, 40.0), (inside + 1, 60.0), (after, 10.0)]
    (gpu,) = sampler.reading(since, until)
    assert gpu.utilization == 50.0  # the two samples within the span
    assert gpu.memory_used == 5 and gpu.name == "Stand-in GPU"
    nvml.samples = [(before, 90.0), (after, 10.0)]
    (gpu,) = sampler.reading(since, until)
    assert gpu.utilization == 10.0  # none within: the sample whose period holds its end


def test_without_driver_samples_the_gpu_is_read_when_asked(nvml):
    sampler = GpuSampler(0, interval=600.0)
    since = time.perf_counter()
    (gpu,) = sampler.reading(since)  # the driver has none: raises NotFound
    assert gpu.utilization == 7.0 and nvml.calls >= 1


def test_a_span_the_thread_sampled_needs_no_nvml_call(nvml):
    sampler = GpuSampler(0, interval=0.001)
    since = time.perf_counter()
    sampler.start()
    deadline = time.monotonic() + 10
    while nvml.calls < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    sampler._thread.join()
    calls = nvml.calls
    (gpu,) = sampler.reading(since)
    assert gpu.utilization == 7.0 and nvml.calls == calls


def test_without_nvml_there_is_a_reason_and_no_reading(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    sampler = GpuSampler(0)
    sampler.start()
    assert sampler.status == "nvidia-ml-py is not installed"
    assert sampler.reading(0.0) == [] and sampler.since_start() == []
    sampler.stop()


def test_a_short_epoch_has_a_gpu_reading_in_stats(nvml):
    # The H100 case: an epoch shorter than the sampling period, NVML answering.
    nvml.samples = [(wall_us(time.perf_counter()) + 10**7, 33.0)]  # the driver's next sample
    loader = FastLoader(torch.arange(8.0), batch_size=4)
    assert len(list(loader)) == 2
    stats = loader.stats()
    assert stats.gpu_status == "ok"
    assert [g.utilization for g in stats.gpu] == [33.0]


def test_before_any_batch_stats_has_no_gpu_reading(nvml):
    assert FastLoader(torch.arange(8.0), batch_size=4).stats().gpu == []


@pytest.mark.gpu
def test_a_short_cuda_epoch_has_a_gpu_reading():
    pytest.importorskip("pynvml")
    loader = FastLoader(torch.randn(64, 3, 32, 32), batch_size=16, device="cuda")
    for batch in loader:
        (batch.float() @ batch.float().transpose(-1, -2)).sum().item()
    stats = loader.stats()
    assert stats.gpu_status == "ok", stats.gpu_status
    assert len(stats.gpu) == 1 and 0 <= stats.gpu[0].utilization <= 100
