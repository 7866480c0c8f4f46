"""The ``pip install`` line that brings one of fastfeed's optional packages, here.

Every hint fastfeed prints comes from :func:`install_line`, so that it works wherever fastfeed
was installed from. fastfeed is installed from its source (a clone, or a wheel built from it),
not from the package index, so a line never names ``fastfeed[extra]``: it names the packages
themselves. And it never replaces the torch that is installed: torchvision is pinned to the
release built for it (torchvision 0.N+15 pairs with torch 2.N), from the index that torch
came from: PyPI for a build without a local label (``2.14.1``), pytorch.org's index of the
label for one with (``2.13.0+cpu``: https://download.pytorch.org/whl/cpu). An unpinned
``torchvision`` would bring its newest release, and with it the newest torch, a CUDA build
of several GB where the CPU build was.
"""

from __future__ import annotations

import re

import torch

__all__ = ["FEATURES", "install_line", "torchvision_pin"]

PYTORCH_INDEX = "https://download.pytorch.org/whl/"

# Optional packages by what they are for: the requirements that bring each (beside the
# torchvision pair where it needs torchvision).
FEATURES: dict[str, tuple[str, ...]] = {
    "torchvision": (),  # fastfeed.vision.accelerate, the nvJPEG decode
    "ultralytics": ("ultralytics",),  # fastfeed.ultralytics.patch()
    "ray": ("ray>=2.40",),  # worker_mode="ray"
    "plot": ("matplotlib",),  # bench.png, the doctor's pictures
    "dali": (),  # backend="dali": the wheel of torch's CUDA major version
}
_NEEDS_TORCHVISION = ("torchvision", "ultralytics")


def torchvision_pin(torch_version: str | None = None) -> str | None:
    """``torchvision==0.28.0`` for torch ``2.13.0`` (the release built for it), or ``None``
    where no release is known to pair with it (a source build, another major version)."""
    release = re.fullmatch(r"2\.(\d+)\.(\d+)(\+[\w.]+)?", torch_version or torch.__version__)
    if release is None:
        return None
    minor, patch = int(release[1]), int(release[2])
    return f"torchvision==0.{minor + 15}.{patch}"


def _index(torch_version: str) -> str | None:
    """pytorch.org's index for a torch build with a local label (``+cpu``, ``+cu126``)."""
    label = torch_version.partition("+")[2]
    return PYTORCH_INDEX + label if re.fullmatch(r"cpu|cu\d+|rocm[\d.]+", label) else None


def _dali(cuda: str | None) -> str:
    # DALI ships one wheel per CUDA major version; its CPU operators run from either.
    return "nvidia-dali-cuda130" if cuda is not None and cuda.startswith("13") else (
        "nvidia-dali-cuda120")


def install_line(feature: str, torch_version: str | None = None, cuda: str | None = None,
                 with_torchvision: bool = True) -> str:
    """The ``pip install`` line for ``feature``, a key of :data:`FEATURES`, beside the
    installed torch (``torch_version``, ``cuda``: torch's own, by default).

    Args:
        with_torchvision: add the torchvision pair for a feature that needs it (leave it out
            where torchvision already imports).
    """
    torch_version = torch_version or torch.__version__
    cuda = torch.version.cuda if cuda is None else cuda
    requirements = list(FEATURES[feature])
    if feature == "dali":
        requirements.append(_dali(cuda))
    index = None
    if feature in _NEEDS_TORCHVISION and with_torchvision:
        pin = torchvision_pin(torch_version)
        if pin is None:
            return (f"pip install {' '.join([*requirements, 'torchvision'])} (the torchvision "
                    f"release built for your torch {torch_version}: see "
                    "https://github.com/pytorch/vision#installation)")
        requirements.append(pin)
        index = _index(torch_version)
    quoted = [f"'{r}'" if set(r) & set("<>*") else r for r in requirements]  # for the shell
    return " ".join(["pip install", *quoted, *(["--extra-index-url", index] if index else [])])
