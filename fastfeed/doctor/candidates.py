"""What the doctor can offer a script's loader, each as a configuration it can measure.

The script's own loader comes first (``"yours"``); then the lines of fastfeed that apply:

- ``swap``: the import swap, ``FastLoader`` with the same arguments;
- ``workers``: the worker count ``num_workers="auto"`` settles on, given to the script's own
  loader (where it differs from the script's);
- ``accelerate``: ``fastfeed.vision.accelerate(dataset)``, for a torchvision ``ImageFolder``
  whose transforms it recognises (with the swap);
- ``patch`` and ``fast_decode``: ``fastfeed.ultralytics.patch()``, for an Ultralytics dataset;
- ``persistent``: ``persistent_workers=True``, when starting workers is a sizeable share of a
  short epoch;
- ``device`` and ``pin_memory``, and the GPU's own work where it applies: ``gpu_decode``
  (``accelerate(dataset, decode_device="cuda")`` with ``FastLoader(device="cuda")``) and
  ``augment_device`` (``patch(augment_device="cuda")``): when the script trains on a GPU. The
  last two take GPU time from the model's step: they are offered only with a measured gain
  that outweighs it (:mod:`~fastfeed.doctor.recommend`).

What applies but cannot be measured here (pillow-simd when it is not installed, the GPU options
on a machine without one) is returned as :class:`~fastfeed.doctor.findings.Unmeasured`, with
the reason, never a number.
Integrations are imported only when the script's data calls for them: the core knows none.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from fastfeed.doctor.findings import Unmeasured
from fastfeed.doctor.loaders import LoaderSpec
from fastfeed.doctor.stages import DECODE, StageCost
from fastfeed.doctor.trials import BASELINE, Config

__all__ = ["configurations", "gpu_routes", "workers_settle", "yours"]

# Decode functions that open images with Pillow (torchvision's, and by name a user's).
_PILLOW_LOADERS = ("pil_loader", "default_loader", "PIL", "pil")
# Worker start-up as a share of an epoch above which persistent workers are worth measuring.
STARTUP_SHARE = 0.05


def _from(dataset: Any, package: str) -> bool:
    return any(cls.__module__.split(".")[0] == package for cls in type(dataset).__mro__)


@contextlib.contextmanager
def _ultralytics_patched(**options: Any) -> Iterator[None]:
    import fastfeed.ultralytics as fu

    fu.patch(**options)
    try:
        yield
    finally:
        fu.unpatch()


def _accelerate(spec: LoaderSpec) -> tuple[Config | None, Unmeasured | None]:
    from fastfeed.vision.accelerate import accelerate

    change = "dataset = fastfeed.vision.accelerate(dataset)   # with FastLoader"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = accelerate(spec.dataset)
    if fast is spec.dataset:
        reason = str(caught[-1].message) if caught else "the dataset is already fastfeed's"
        return None, Unmeasured(change, f"does not apply: {reason}")
    return Config("accelerate", change, lambda: spec.build(fast=True, dataset=fast),
                  note="your transforms' random draws, pixels within a few grey levels"), None


def _ultralytics_loader(spec: LoaderSpec) -> DataLoader:
    """The loader ``patch()`` makes of the script's: Ultralytics' loader class as patched,
    over the batch sampler that Ultralytics' own loader repeats."""
    from ultralytics.data import build

    return spec.build(fast=True, kind=build.InfiniteDataLoader,
                      batch_sampler=spec.inner_batch_sampler())


def _ultralytics(spec: LoaderSpec) -> list[Config]:
    import fastfeed.ultralytics as fu

    if fu.is_patched():  # the script patched it itself: its loader is measured as it is
        return []
    build = lambda: _ultralytics_loader(spec)  # noqa: E731
    return [Config("patch", "fastfeed.ultralytics.patch()   # before model.train(...)", build,
                   context=_ultralytics_patched),
            Config("fast_decode", "fastfeed.ultralytics.patch(fast_decode=True)", build,
                   context=lambda: _ultralytics_patched(fast_decode=True),
                   note="large JPEGs decoded at a reduced scale")]


def _pillow_simd() -> bool:
    try:
        importlib.metadata.version("Pillow-SIMD")
    except importlib.metadata.PackageNotFoundError:
        import PIL

        return ".post" in PIL.__version__  # pillow-simd's versions, installed under PIL's name
    return True


def yours(spec: LoaderSpec) -> Config:
    """The script's own loader, rebuilt: what every option is compared with."""
    base = "FastLoader" if spec.fast else "torch's DataLoader"
    return Config(BASELINE, "", lambda: spec.build(),
                  note=f"{spec.kind.rsplit('.', 1)[-1]}'s arguments on {base}")


def workers_settle(spec: LoaderSpec) -> bool:
    """Whether to let ``num_workers="auto"`` settle on this loader's data first: not where it
    is in use already, nor for an IterableDataset (auto keeps its starting count there), nor
    for Ultralytics (which sets the count from ``model.train(workers=...)``)."""
    return (spec.workers != "auto" and not isinstance(spec.dataset, IterableDataset)
            and not _from(spec.dataset, "ultralytics"))


def _workers(spec: LoaderSpec, settled: int | None) -> list[Config]:
    if settled is None or settled == spec.workers:
        return []
    return [Config("workers", f"DataLoader(..., num_workers={settled})",
                   lambda: spec.build(num_workers=settled),
                   note='the count num_workers="auto" settled on here')]


def _persistent(spec: LoaderSpec, startup_share: float | None, trial_batches: int
                ) -> tuple[list[Config], list[Unmeasured]]:
    change = "DataLoader(..., persistent_workers=True)"
    if (spec.workers == 0 or spec.arguments["persistent_workers"] or startup_share is None
            or startup_share < STARTUP_SHARE):
        return [], []
    if spec.length is None or 2 * spec.length > trial_batches:
        return [], [Unmeasured(change, (
            f"starting workers took {100 * startup_share:.0f}% of an epoch, but epochs are "
            f"longer than a loader-alone run ({trial_batches} batches)"))]
    return [Config("yours, whole epochs", "", lambda: spec.build(), epochs=True),
            Config("persistent", change, lambda: spec.build(persistent_workers=True),
                   epochs=True, against="yours, whole epochs",
                   note="timed over whole epochs, start-up included")], []


def _gpu_decode(spec: LoaderSpec, device: torch.device) -> Config:
    """``accelerate(dataset, decode_device=...)``: the JPEGs decoded on the script's GPU, in a
    FastLoader that delivers there."""
    from fastfeed.vision.accelerate import accelerate

    def build() -> DataLoader:
        fast = accelerate(spec.dataset, decode_device=str(device))
        return spec.build(fast=True, dataset=fast, device=str(device))

    return Config("gpu_decode", f'dataset = fastfeed.vision.accelerate(dataset, decode_device='
                  f'"{device.type}")   # with FastLoader(device="{device.type}")', build,
                  gpu_work=True, note="decodes on the GPU, which your model step shares")


def _augment_device(spec: LoaderSpec, device: torch.device) -> Config:
    """``patch(augment_device=...)``: Ultralytics' warp, HSV and flips on the script's GPU."""
    return Config("augment_device", f'fastfeed.ultralytics.patch(augment_device="{device.type}")',
                  lambda: _ultralytics_loader(spec),
                  context=lambda: _ultralytics_patched(augment_device=str(device)),
                  gpu_work=True, note="augments on the GPU, which your model step shares")


def gpu_routes(accelerates: bool, ultralytics: bool) -> list[str]:
    """The GPU changes that apply to a loader: the device copy for any, GPU decode for a
    torchvision pipeline that :func:`fastfeed.vision.accelerate` recognises, GPU augmentation
    for an Ultralytics dataset."""
    return (['device="cuda", pin_memory=True']
            + (['accelerate(dataset, decode_device="cuda")'] if accelerates else [])
            + (['fastfeed.ultralytics.patch(augment_device="cuda")'] if ultralytics else []))


def _gpu(spec: LoaderSpec, device: torch.device | None, accelerates: bool, ultralytics: bool,
         cuda: bool) -> tuple[list[Config], list[Unmeasured]]:
    """The GPU options, measured where the script trains on a GPU; named, unmeasured, where
    the machine has none; nothing where the script trains on the CPU of a GPU machine."""
    if device is None:
        return [], ([] if cuda else [Unmeasured(", ".join(gpu_routes(accelerates, ultralytics)),
                                                "no GPU on this machine")])
    configs = []
    if spec.options.get("device") is None:  # not a FastLoader that delivers there already
        configs.append(Config("device", f'FastLoader(..., device="{device.type}")',
                              lambda: spec.build(fast=True, device=str(device))))
        if not spec.arguments["pin_memory"]:
            configs.append(Config("pin_memory", "DataLoader(..., pin_memory=True)",
                                  lambda: spec.build(pin_memory=True)))
    if accelerates:
        configs.append(_gpu_decode(spec, device))
    if ultralytics:
        configs.append(_augment_device(spec, device))
    return configs, []


def _pillow(stages: list[StageCost]) -> list[Unmeasured]:
    decode = next((s for s in stages if s.kind == DECODE and any(
        name in s.stage for name in _PILLOW_LOADERS)), None)
    if decode is None or _pillow_simd():
        return []
    return [Unmeasured("pip install pillow-simd", (
        f"not installed here, so its speed on your images cannot be measured (Pillow's "
        f"decode costs {decode.ms:.2f} ms per sample)"))]


def configurations(spec: LoaderSpec, stages: list[StageCost], device: torch.device | None,
                   startup_share: float | None, trial_batches: int,
                   settled_workers: int | None = None, cuda: bool | None = None
                   ) -> tuple[list[Config], list[Unmeasured]]:
    """The script's loader and the options that apply to it, and those that cannot be measured.

    Args:
        spec: the script's loader.
        stages: its per-sample stages (a Pillow decode calls for pillow-simd).
        device: the CUDA device the script trains on, or ``None``.
        startup_share: worker start-up's share of an epoch, if known.
        trial_batches: batches a loader-alone run times (an epoch must fit twice in it for
            persistent workers to show).
        settled_workers: the count ``num_workers="auto"`` settled on, where it was let settle
            (:func:`workers_settle`).
        cuda: whether the machine has a GPU (default: ``torch.cuda.is_available()``).
    """
    configs = [yours(spec)]
    unmeasured: list[Unmeasured] = []
    ultralytics = _from(spec.dataset, "ultralytics")
    if ultralytics:
        configs += _ultralytics(spec)
    elif not spec.fast:
        configs.append(Config("swap", "from fastfeed import FastLoader as DataLoader",
                              lambda: spec.build(fast=True)))
    configs += _workers(spec, settled_workers)
    accelerated = None
    if _from(spec.dataset, "torchvision"):
        accelerated, skipped = _accelerate(spec)
        configs += [accelerated] if accelerated is not None else []
        unmeasured += [skipped] if skipped is not None else []
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for more, cannot in (_persistent(spec, startup_share, trial_batches),
                         _gpu(spec, device, accelerated is not None,
                              ultralytics and any(c.key == "patch" for c in configs), cuda)):
        configs += more
        unmeasured += cannot
    return configs, unmeasured + _pillow(stages)
