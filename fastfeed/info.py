"""``python -m fastfeed info``: what fastfeed sees on this machine, and for each feature that
needs more than the core, what is missing and the ``pip install`` line that brings it."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import shutil

import numpy as np
import PIL
import torch

import fastfeed
from fastfeed._imports import importable
from fastfeed._install import install_line
from fastfeed._stack import extension_loaded
from fastfeed.autotune import available_cpus
from fastfeed.nvml import nvml_status
from fastfeed.slots import slots_supported
from fastfeed.vision.jpeg_decoders import describe as describe_gpu_decoder
from fastfeed.vision.libjpeg import describe as describe_window_decoder

__all__ = ["collect", "features", "format_report", "pillow_is_simd"]


def pillow_is_simd() -> bool:
    """Whether the installed ``PIL`` is pillow-simd (a faster, compiled drop-in)."""
    try:
        importlib.metadata.distribution("Pillow-SIMD")
        return True
    except importlib.metadata.PackageNotFoundError:
        return ".post" in PIL.__version__


def _shm() -> str:
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError:
        return "absent"
    return f"{usage.total / 2**30:.1f} GiB ({usage.free / 2**30:.1f} GiB free)"


def _client(distribution: str, module: str) -> str:
    """The installed version of a client library, and whether it imports here."""
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    return version if importable(module) else f"{version}, but it does not import here"


# DALI's wheels, one per CUDA major version (the CUDA 13 builds of torch pair with cuda130).
_DALI = ("nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali-cuda110")


def _dali() -> str:
    for distribution in _DALI:
        try:
            return f"{importlib.metadata.version(distribution)} ({distribution})"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def _yolo_kernel(module: str, op: str) -> str:
    """Whether a YOLO pixel kernel (``fastfeed._warp``, ``fastfeed._hsv``) runs here."""
    try:
        kernel = importlib.import_module(f"fastfeed.{module}")
    except ImportError:
        return f"not built: Ultralytics keeps OpenCV's {op}"
    if not kernel.available():
        return f"built, but this CPU has no AVX2/FMA: Ultralytics keeps OpenCV's {op}"
    return f"fastfeed.{module} (taken where it gives OpenCV's bytes)"


def collect() -> dict[str, str]:
    """Gather the facts ``fastfeed info`` prints, as strings."""
    cuda = torch.cuda.is_available()
    nvml = nvml_status()
    return {
        "fastfeed": fastfeed.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "Pillow": PIL.__version__ + (" (pillow-simd)" if pillow_is_simd() else ""),
        "C++ extension": "loaded" if extension_loaded() else "not built: pure-torch copy path",
        "JPEG window decoder": describe_window_decoder(),
        "YOLO warp kernel": _yolo_kernel("_warp", "warp"),
        "YOLO HSV kernel": _yolo_kernel("_hsv", "HSV"),
        "YOLO shared cache": "fastfeed._flags" if importable("fastfeed._flags")
        else "not built: patch(cache='shared') is off",
        "crop-window draws": "fastfeed._mt19937" if importable("fastfeed._mt19937")
        else "not built: torchvision's ops draw accelerate's windows",
        "shared-memory slots": "memfd" if slots_supported() else "unsupported here: ordinary path",
        "CUDA": f"{torch.version.cuda} ({torch.cuda.device_count()} device(s))"
        if cuda
        else f"not available (torch built for CUDA {torch.version.cuda})"
        if torch.version.cuda
        else "not available (CPU-only torch)",
        "GPU": ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        if cuda
        else "none",
        "NVML": f"driver {nvml.driver}, {len(nvml.gpus)} GPU(s)"
        if nvml.available
        else f"unavailable ({nvml.reason})",
        "DALI": _dali(),
        "torchvision": _client("torchvision", "torchvision"),
        "GPU JPEG decoder": describe_gpu_decoder(),
        "Ultralytics": _client("ultralytics", "ultralytics"),
        "CPUs (affinity)": str(available_cpus()),
        "/dev/shm": _shm(),
    }


READY = "ready"


def _needs(what: str, feature: str, with_torchvision: bool = True) -> str:
    return f"needs {what}: {install_line(feature, with_torchvision=with_torchvision)}"


def _installed(*distributions: str) -> bool:
    """Whether one of ``distributions`` is installed (a folder of the module's name in the
    current directory imports as a namespace package, and is not the library)."""
    for distribution in distributions:
        try:
            importlib.metadata.version(distribution)
            return True
        except importlib.metadata.PackageNotFoundError:
            continue
    return False


def _usable(module: str, *distributions: str) -> bool:
    return _installed(*distributions) and importable(module)


def features() -> dict[str, str]:
    """For each feature beyond the core: :data:`READY`, or what it needs and the line that
    brings it (a line that keeps the installed torch; see :mod:`fastfeed._install`)."""
    vision = _usable("torchvision", "torchvision")
    gpu = None if torch.cuda.is_available() else (
        "a GPU: CUDA is not available here" + ("" if torch.version.cuda else
                                               " (this torch is a CPU-only build)"))
    return {
        "FastLoader, fastfeed doctor, bench": READY,
        "fastfeed.vision.accelerate": READY if vision else _needs(
            "torchvision, the release built for this torch", "torchvision"),
        "fastfeed.ultralytics.patch()": READY if _usable("ultralytics", "ultralytics") else
        _needs("Ultralytics" + ("" if vision else " and torchvision"), "ultralytics",
               with_torchvision=not vision),
        'device="cuda", augment_device="cuda"': f"needs {gpu}" if gpu else READY,
        'decode_device="cuda" (nvJPEG)': f"needs {gpu}" if gpu else READY if vision else
        _needs("torchvision", "torchvision"),
        'backend="dali" (NVIDIA DALI)': READY if _usable("nvidia.dali", *_DALI) else _needs(
            "NVIDIA DALI", "dali"),
        'worker_mode="ray"': READY if _usable("ray", "ray") else _needs("Ray", "ray"),
        "charts (bench.png, doctor --out)": READY if _usable("matplotlib", "matplotlib")
        else _needs("matplotlib", "plot"),
    }


def format_report(facts: dict[str, str], needs: dict[str, str] | None = None) -> str:
    """Align ``facts`` as ``key : value`` lines, then, under a heading, ``needs`` (what
    :func:`features` returns)."""
    width = max(len(key) for key in [*facts, *(needs or {})])
    lines = [f"{key:<{width}} : {value}" for key, value in facts.items()]
    if needs:
        lines += ["", "Features beyond the core, and what each needs here:"]
        lines += [f"{key:<{width}} : {value}" for key, value in needs.items()]
    return "\n".join(lines)
