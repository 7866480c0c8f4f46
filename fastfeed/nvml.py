"""NVML (nvidia-ml-py) access that fails soft: no GPU, no driver or no library gives a reason,
never an exception."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GpuSample", "NvmlStatus", "nvml_handle", "nvml_status", "sample_gpu", "sample_gpus",
           "utilization_samples"]


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU."""

    index: int  # NVML's index: the machine's PCI order, not CUDA's numbering in this process
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


def nvml_handle(device: int | str) -> object:
    """The NVML handle of ``device``: an NVML index, or a UUID or UUID prefix as
    :func:`fastfeed.which_gpu.nvml_device_for` returns them. Requires a prior NVML init.

    Raises:
        LookupError: no GPU has that UUID (or the prefix matches several).
    """
    import pynvml

    if isinstance(device, int):
        return pynvml.nvmlDeviceGetHandleByIndex(device)
    # CUDA accepts unique UUID prefixes in CUDA_VISIBLE_DEVICES; NVML wants the whole UUID.
    matches = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        if str(pynvml.nvmlDeviceGetUUID(handle)).startswith(device):
            matches.append(handle)
    if len(matches) != 1:
        raise LookupError(f"{len(matches)} GPUs have a UUID starting with {device!r}")
    return matches[0]


def sample_gpu(handle: object) -> GpuSample:
    """Read utilization and memory of one GPU, given its :func:`nvml_handle`."""
    import pynvml

    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return GpuSample(
        index=int(pynvml.nvmlDeviceGetIndex(handle)),
        name=str(pynvml.nvmlDeviceGetName(handle)),
        utilization=float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        memory_used=int(memory.used),
        memory_total=int(memory.total),
    )


def utilization_samples(handle: object, since_us: int) -> list[tuple[int, float]]:
    """The GPU's utilisation as the driver sampled it after ``since_us`` (microseconds since
    the epoch, the driver's clock): ``(timestamp, percent)``, oldest first. The driver keeps
    the last few seconds of samples, each covering its own sampling period (a sixth of a
    second to a second, by GPU): a span shorter than the period of a thread polling
    :func:`sample_gpu` still has one.

    Raises:
        pynvml.NVMLError: the GPU keeps no samples, or none are that recent.
    """
    import pynvml

    _, samples = pynvml.nvmlDeviceGetSamples(handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES,
                                             since_us)
    return sorted((int(s.timeStamp), float(s.sampleValue.uiVal)) for s in samples)


def sample_gpus() -> list[GpuSample]:
    """Read every GPU of the machine (``fastfeed info``). Requires a prior NVML init."""
    import pynvml

    return [sample_gpu(pynvml.nvmlDeviceGetHandleByIndex(index))
            for index in range(pynvml.nvmlDeviceGetCount())]


def nvml_status() -> NvmlStatus:
    """Initialise NVML and read every GPU once; on any failure, say why."""
    try:
        driver = _init()
        return NvmlStatus(True, driver=driver, gpus=sample_gpus())
    except ImportError:
        return NvmlStatus(False, "nvidia-ml-py is not installed")
    except Exception as error:  # pynvml raises NVMLError subclasses per cause
        return NvmlStatus(False, f"{type(error).__name__}: {error}")
