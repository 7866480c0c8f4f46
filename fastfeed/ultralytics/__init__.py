"""One line for Ultralytics YOLO training: its loaders become FastLoaders.

.. code-block:: python

    import fastfeed.ultralytics
    from ultralytics import YOLO

    fastfeed.ultralytics.patch()
    YOLO("yolov8n.yaml").train(data="coco8.yaml", epochs=3, workers=8)

Ultralytics builds every loader (train, val, INT8 calibration) in
``ultralytics.data.build.build_dataloader``, from its ``InfiniteDataLoader`` class. :func:`patch`
puts :class:`InfiniteFastLoader` in that class's place, so the loaders are FastLoaders built with
exactly Ultralytics' arguments: its seeded generator, ``seed_worker``, ``prefetch_factor``,
samplers under DDP, ``collate_fn`` and ``drop_last``. Batches equal the stock loader's.
Ultralytics' default random perspective (a scale and a translation) takes a separable warp that
gives OpenCV's bytes in a third of its time (:mod:`fastfeed.ultralytics.warp`).

Multi-GPU training runs in processes that Ultralytics starts from a script it writes, which
rebuild the trainer from a pickle: :func:`patch` gives that trainer a callback that patches each
of those processes the same way before it builds its loaders.

Ultralytics is optional: ``python -m fastfeed info`` prints the line that installs it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastfeed._imports import importable
from fastfeed._install import install_line
from fastfeed._patching import Patch, Swaps
from fastfeed.backends import backends_for
from fastfeed.device import check_device
from fastfeed.ultralytics import shared_cache
from fastfeed.ultralytics.infinite_loader import InfiniteFastLoader

__all__ = ["InfiniteFastLoader", "PatchInWorkers", "is_patched", "patch", "patched", "unpatch"]


def patch(fast_decode: bool = False, augment_device: str | None = None,
          cache: str | None = None, cache_budget_gib: float | None = None,
          **fastloader_options: Any) -> None:
    r"""Make Ultralytics load its batches with :class:`InfiniteFastLoader`.

    Call it once before ``model.train(...)``. Calling it again replaces the options; the
    loaders built before a call keep what they were built with. ``RandomPerspective`` also
    warps scale-and-translate matrices (Ultralytics' defaults) with a separable kernel whose
    output is OpenCV's, byte for byte (:mod:`fastfeed.ultralytics.warp`).

    Args:
        fast_decode (bool): decode JPEGs at least twice ``imgsz`` at a reduced DCT scale
            (see :mod:`fastfeed.ultralytics.reduced_decode`). Output sizes are Ultralytics'; pixels
            differ slightly from its full-size decode, so this is opt-in. Default: ``False``.
        augment_device (str, optional): run the training loader's random perspective warp,
            HSV jitter and flips on this device (``"cuda"``), as batch ops on the copy stream;
            workers still draw every random number with Ultralytics' code, so labels are the
            stock ones; the ops are OpenCV 5's arithmetic, and with ``"cpu"`` the images equal
            the stock ones byte for byte (on an H100, the GPU's warp and HSV gave the CPU's
            bytes). The loader then delivers batches on that device.
            ``"cpu"`` runs the same ops in the main process: a reference, slower than the
            workers. Pipelines with
            other pixel work after the warp (mixup, cutmix, perspective, Albumentations) stay
            on the CPU, with a warning. See :mod:`fastfeed.ultralytics.gpu_augment`.
            Default: ``None``.
        cache (str, optional): ``"shared"``: datasets that Ultralytics caches in RAM
            (``train(cache="ram")`` or ``cache=True``) keep one copy of the decoded images per
            machine, in ``/dev/shm``, that every DDP rank and every worker maps, filled by
            whichever process decodes an image first; the images are those of Ultralytics'
            own ``cache="ram"``, byte for byte (:mod:`fastfeed.ultralytics.shared_cache`).
            Default: ``None`` (Ultralytics' cache, one per process).
        cache_budget_gib (float, optional): the most the shared cache may take; past it (or
            past the free space of ``/dev/shm``) a warning says so and the images are decoded
            on every read. Default: ``None`` (the free space).
        **fastloader_options: :class:`~fastfeed.FastLoader` keywords that ``DataLoader`` does
            not have, for every loader Ultralytics builds: for example ``worker_mode="thread"``
            or ``log_every=100``.

    Raises:
        ImportError: Ultralytics is not installed.
        TypeError: an option is not a FastLoader-only keyword.
        ValueError: ``augment_device`` is not a device of this machine, or comes with thread
            workers, or with ``device`` or ``gpu_transform`` among the options (it sets both);
            ``cache`` is not ``None`` or ``"shared"``.

    .. note:: Multi-GPU (DDP) training is patched too: Ultralytics' workers rebuild the
       trainer from a pickle, with a callback added here that calls :func:`patch` with these
       arguments in each of them.
    """
    _patch.patch(fast_decode=fast_decode, augment_device=augment_device, cache=cache,
                 cache_budget_gib=cache_budget_gib, **fastloader_options)


def _check_augment_device(augment_device: str | None, fastloader_options: dict[str, Any]
                          ) -> None:
    if augment_device is None:
        return
    worker_mode = fastloader_options.get("worker_mode", "process")
    if any(backend.traits.in_this_process for backend in backends_for(worker_mode)):
        raise ValueError("augment_device needs worker processes: each records its own "
                         "samples' parameters (worker_mode='process')")
    if "device" in fastloader_options or "gpu_transform" in fastloader_options:
        raise ValueError("augment_device sets the loader's device and gpu_transform")
    check_device(augment_device)  # now, rather than when training builds its loaders


def _swap_ultralytics(swaps: Swaps, fastloader_options: dict[str, Any], *,
                      fast_decode: bool = False, augment_device: str | None = None,
                      cache: str | None = None, cache_budget_gib: float | None = None) -> None:
    """Replace, in ``swaps``, what :func:`patch` changes in Ultralytics; each replacement is
    made from Ultralytics' own attribute, so a second call starts again from it."""
    if not importable("ultralytics"):
        raise ImportError("fastfeed.ultralytics.patch() needs Ultralytics: "
                          f"{install_line('ultralytics')}")
    _check_augment_device(augment_device, fastloader_options)
    if cache not in (None, "shared"):
        raise ValueError(f"cache must be None or 'shared', got {cache!r}")
    if cache == "shared" and not shared_cache.available():
        warnings.warn("fastfeed was installed without its C++ extensions (no compiler): "
                      "cache='shared' is off, and cache='ram' stays Ultralytics' own",
                      RuntimeWarning, stacklevel=4)  # at the call of patch()
        cache = None

    from ultralytics.data import augment, base, build
    from ultralytics.utils import dist

    from fastfeed.ultralytics.hsv import exact_hsv
    from fastfeed.ultralytics.labels import copy_labels
    from fastfeed.ultralytics.mosaic import lazy_mosaic
    from fastfeed.ultralytics.reduced_decode import reduced_load_image
    from fastfeed.ultralytics.warp import exact_warp

    shared = cache == "shared"
    arguments = {"fast_decode": fast_decode, "augment_device": augment_device, "cache": cache,
                 "cache_budget_gib": cache_budget_gib, **fastloader_options}

    def load_image(original: Callable[..., Any]) -> Callable[..., Any]:
        if fast_decode:
            original = reduced_load_image(original)
        return shared_cache.shared_load_image(original) if shared else original

    def cache_images(original: Callable[..., Any]) -> Callable[..., Any]:
        if not shared:
            return original
        return shared_cache.shared_cache_images(original, cache_budget_gib,
                                                "reduced" if fast_decode else "full")

    def check_cache_ram(original: Callable[..., Any]) -> Callable[..., Any]:
        return shared_cache.shared_check_cache_ram(original) if shared else original

    swaps.set(build, "InfiniteDataLoader", type(
        InfiniteFastLoader.__name__, (InfiniteFastLoader,),
        {"fastloader_options": dict(fastloader_options), "augment_device": augment_device,
         "__module__": __name__}))
    swaps.wrap(base.BaseDataset, "load_image", load_image)
    swaps.wrap(base.BaseDataset, "cache_images", cache_images)
    swaps.wrap(base.BaseDataset, "check_cache_ram", check_cache_ram)
    swaps.set(base, "deepcopy", copy_labels)  # get_image_and_label's copy of labels
    swaps.wrap(dist, "generate_ddp_file",
                lambda original: _patching_ddp_workers(original, arguments))
    if "apply_image" in vars(augment.RandomPerspective):  # its warp since Ultralytics 8.4
        swaps.wrap(augment.RandomPerspective, "apply_image", exact_warp)
        swaps.wrap(augment.Mosaic, "apply_image", lazy_mosaic)
    swaps.wrap(augment.RandomHSV, "apply_image", exact_hsv)


_patch = Patch(_swap_ultralytics)
unpatch, is_patched, patched = _patch.unpatch, _patch.is_patched, _patch.patched


class PatchInWorkers:
    """A trainer callback (``on_pretrain_routine_start``, before any loader is built) that calls
    :func:`patch` with ``arguments`` in a process where it has not been called: one of
    Ultralytics' DDP workers, which unpickle the trainer and its callbacks."""

    def __init__(self, arguments: dict[str, Any]) -> None:
        self.arguments = arguments

    def __call__(self, trainer: Any) -> None:
        if not is_patched():
            patch(**self.arguments)


def _patching_ddp_workers(generate_ddp_file: Callable[[Any], str], arguments: dict[str, Any]
                          ) -> Callable[[Any], str]:
    """Ultralytics' ``generate_ddp_file``, which pickles the trainer for its DDP workers, with
    a :class:`PatchInWorkers` callback among the trainer's callbacks while it does."""

    def with_patch(trainer: Any) -> str:
        callback = PatchInWorkers(arguments)
        trainer.add_callback("on_pretrain_routine_start", callback)
        try:
            script = generate_ddp_file(trainer)
        finally:  # the trainer shares its callbacks with the YOLO model, which outlives it
            trainer.callbacks["on_pretrain_routine_start"].remove(callback)
        if "_callbacks" not in Path(script).read_text():
            warnings.warn("fastfeed: this Ultralytics' DDP script does not hand the trainer's "
                          "callbacks to its workers, so they load with Ultralytics' own loader "
                          "(Ultralytics 8.4.190 hands them over)", RuntimeWarning, stacklevel=2)
        return script

    return with_patch
