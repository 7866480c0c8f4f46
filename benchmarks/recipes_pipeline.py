"""The CNN training recipes people run, under the stock DataLoader and fastfeed.

Three recipes over torchvision's ``ImageFolder`` (batch 64, shuffled, persistent workers):

- ``reference``: torchvision's reference classification script's training preset, an object
  holding a ``Compose`` in ``.transforms`` (RandomResizedCrop 224 bilinear, flip,
  PILToTensor, ConvertImageDtype, Normalize): :class:`ReferencePresetTrain`.
- ``timm``: timm's ``create_transform(224, is_training=True)`` (RandomResizedCropAndInterpolation,
  flip, ColorJitter(0.4), MaybeToTensor, Normalize).
- ``timm-ra``: the same with ``auto_augment="rand-m9-mstd0.5"`` and ``re_prob=0.25``
  (RandAugment, RandomErasing).

Each under three loaders: ``stock`` (``torch.utils.data.DataLoader``), ``swap`` (``FastLoader``
with the same arguments) and ``accelerate`` (``FastLoader`` over
``fastfeed.vision.accelerate(dataset)``). Each run is a fresh process that builds the loader,
runs one warm-up epoch, then times ``--epochs`` epochs; the loaders alternate order from
repeat to repeat; the table gives the median images/s over every timed epoch of every repeat,
the spread (min–max) and the ratio to the recipe's ``stock``. Needs torchvision and timm. The
data (``--images`` ImageNet-like JPEGs, about 500×375, q90) is generated on first use and never
committed.

    python benchmarks/recipes_pipeline.py --json benchmarks/out/recipes.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.interleaved import interleaved_rates, pipeline_parser

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
LOADERS = ("stock", "swap", "accelerate")


class ReferencePresetTrain:
    """The shape of torchvision's reference training preset (``references/classification/
    presets.py``, PIL backend, no auto-augment): a ``Compose`` in ``.transforms``, called
    through."""

    def __init__(self, crop_size: int = 224, hflip_prob: float = 0.5,
                 random_erase_prob: float = 0.0) -> None:
        import torch
        from torchvision import transforms as T

        steps: list[Any] = [T.RandomResizedCrop(crop_size, antialias=True)]
        if hflip_prob > 0:
            steps.append(T.RandomHorizontalFlip(hflip_prob))
        steps += [T.PILToTensor(), T.ConvertImageDtype(torch.float), T.Normalize(MEAN, STD)]
        if random_erase_prob > 0:
            steps.append(T.RandomErasing(p=random_erase_prob))
        self.transforms = T.Compose(steps)

    def __call__(self, img: Any) -> Any:
        return self.transforms(img)


class ReferencePresetEval:
    """The shape of torchvision's reference evaluation preset: Resize, CenterCrop,
    PILToTensor, ConvertImageDtype, Normalize, in ``.transforms``."""

    def __init__(self, crop_size: int = 224, resize_size: int = 256) -> None:
        import torch
        from torchvision import transforms as T

        self.transforms = T.Compose([
            T.Resize(resize_size, antialias=True), T.CenterCrop(crop_size), T.PILToTensor(),
            T.ConvertImageDtype(torch.float), T.Normalize(MEAN, STD)])

    def __call__(self, img: Any) -> Any:
        return self.transforms(img)


def _timm(**options: Any) -> Any:
    from timm.data import create_transform

    return create_transform(224, is_training=True, **options)


RECIPES: dict[str, Callable[[], Any]] = {
    "reference": ReferencePresetTrain,
    "timm": _timm,
    "timm-ra": lambda: _timm(auto_augment="rand-m9-mstd0.5", re_prob=0.25),
}


def epochs_per_s(config: str, root: Path, workers: int, batch_size: int, epochs: int
                 ) -> list[float]:
    """Images/s of each timed epoch of one ``recipe/loader`` configuration (in this process)."""
    from torch.utils.data import DataLoader
    from torchvision import datasets

    from fastfeed import FastLoader
    from fastfeed.vision import accelerate

    recipe, loader_name = config.split("/")
    dataset = datasets.ImageFolder(str(root), transform=RECIPES[recipe]())
    kwargs = {"batch_size": batch_size, "shuffle": True, "num_workers": workers,
              "persistent_workers": True}
    if loader_name == "stock":
        loader = DataLoader(dataset, **kwargs)
    else:
        loader = FastLoader(accelerate(dataset) if loader_name == "accelerate" else dataset,
                            **kwargs)
    rates = []
    for epoch in range(epochs + 1):
        start, images = time.perf_counter(), 0
        for batch, _ in loader:
            images += len(batch)
        if epoch:  # the first epoch starts the workers: a warm-up
            rates.append(images / (time.perf_counter() - start))
    return rates


def print_recipe_table(title: str, rates: dict[str, list[float]]) -> None:
    """One row per configuration: median, spread, and the ratio to the recipe's stock row."""
    print(title)
    print("| recipe | loader | images/s (median) | min–max | vs stock |\n|---|---|---|---|---|")
    for config, values in rates.items():
        recipe, loader = config.split("/")
        median = statistics.median(values)
        stock = rates.get(f"{recipe}/stock")
        ratio = f"**{median / statistics.median(stock):.2f}×**" if stock else "n/a"
        print(f"| {recipe} | {loader} | {median:,.0f} | {min(values):,.0f}–{max(values):,.0f} "
              f"| {ratio} |")


def main() -> None:
    configs = [f"{recipe}/{loader}" for recipe in RECIPES for loader in LOADERS]
    parser = pipeline_parser(__doc__, configs, batch_size=64)
    parser.add_argument("--data", type=Path, default=None,
                        help="an ImageFolder (default: generate --images into the cache)")
    parser.add_argument("--images", type=int, default=600)
    args = parser.parse_args()

    if args.one:
        print(json.dumps(epochs_per_s(args.one, args.data, args.workers, args.batch_size,
                                      args.epochs)))
        return

    from fastfeed.bench.data import CACHE
    from fastfeed.vision.synthetic import make_imagefolder

    root = args.data
    if root is None:
        root = CACHE / f"imagenet-like-{args.images}"
        if not root.exists():
            make_imagefolder(root, args.images, classes=50)
    rates = interleaved_rates(
        __file__, args.configs.split(","), args.repeats,
        ["--data", str(root), "--workers", str(args.workers), "--batch-size",
         str(args.batch_size), "--epochs", str(args.epochs)], desc="recipes")
    title = (f"CNN recipes over torchvision's ImageFolder, {root.name}: batch {args.batch_size}, "
             f"{args.workers} workers, {args.repeats} runs × {args.epochs} epochs")
    print_recipe_table(title, rates)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"title": title, "rates": rates}, indent=2))


if __name__ == "__main__":
    main()
