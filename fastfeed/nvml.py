"""NVML (nvidia-ml-py) access that fails soft: no GPU, no driver or no library gives a reason,
never an exception."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GpuSample", "NvmlStatus", "nvml_status", "sample_gpus"]


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU."""

    index: int
    name: str
    utilization: float  # percent of the last sample period the GPU was busy
    memory_used: int
    memory_total: int


@dataclass(frozen=True)
class NvmlStatus:
    """Whether NVML works here and, if not, why."""

    available: bool
    reason: str = ""
    driver: str = ""
    gpus: list[GpuSample] = field(default_factory=list)


def _init() -> str:
    import pynvml

    pynvml.nvmlInit()
    return str(pynvml.nvmlSystemGetDriverVersion())


def sample_gpus() -> list[GpuSample]:
    """Read utilization and memory of every GPU. Requires a prior successful NVML init."""
    import pynvml

    samples = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        samples.append(
            GpuSample(
                index=index,
                name=str(pynvml.nvmlDeviceGetName(handle)),
                utilization=float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                memory_used=int(memory.used),
                memory_total=int(memory.total),
            )
        )
    return samples


def nvml_status() -> NvmlStatus:
    """Initialise NVML and read every GPU once; on any failure, say why."""
    try:
        driver = _init()
        return NvmlStatus(True, driver=driver, gpus=sample_gpus())
    except ImportError:
        return NvmlStatus(False, "nvidia-ml-py is not installed")
    except Exception as error:  # pynvml raises NVMLError subclasses per cause
        return NvmlStatus(False, f"{type(error).__name__}: {error}")
