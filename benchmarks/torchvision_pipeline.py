"""A user's own torchvision training pipeline under the stock DataLoader and fastfeed.

The dataset is torchvision's ``ImageFolder`` with the classic ImageNet train transforms
(RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize), batch 64, shuffled,
persistent workers: what ``examples/train_resnet.py``-style scripts use. Configurations:

- ``stock``: ``torch.utils.data.DataLoader``.
- ``swap``: ``FastLoader`` with the same arguments (the one-import change).
- ``accelerate``: ``FastLoader`` over ``fastfeed.vision.accelerate(dataset)``.
- ``accelerate-threads``: the same with ``worker_mode="thread"``.
- ``swap-auto``: the swap with ``num_workers="auto", worker_mode="auto"`` (not in the default
  set; ``--configs stock,swap,swap-auto``).

Each run is a fresh process that builds the loader, runs one warm-up epoch, then times
``--epochs`` epochs; configurations alternate order from repeat to repeat; the table gives the
median images/s over every timed epoch of every repeat, and the ratio to ``stock``.
Needs torchvision. The data (``--images`` ImageNet-like JPEGs, about 500×375, q90, 18 KB each)
is generated on first use and never committed.

    python benchmarks/torchvision_pipeline.py --json benchmarks/out/torchvision.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.interleaved import interleaved_rates, pipeline_parser, print_ratio_table

CONFIGS = ("stock", "swap", "accelerate", "accelerate-threads")
EXTRA_CONFIGS = ("swap-auto",)


def epochs_per_s(config: str, root: Path, workers: int, batch_size: int, epochs: int
                 ) -> list[float]:
    """Images/s of each timed epoch of one configuration (run in this process)."""
    from torch.utils.data import DataLoader

    from fastfeed import FastLoader
    from fastfeed.bench.data import classic_imagefolder

    dataset = classic_imagefolder(root, accelerated=config.startswith("accelerate"))
    kwargs = {"batch_size": batch_size, "shuffle": True, "num_workers": workers,
              "persistent_workers": True}
    if config == "stock":
        loader = DataLoader(dataset, **kwargs)
    elif config == "swap-auto":
        loader = FastLoader(dataset, **{**kwargs, "num_workers": "auto"}, worker_mode="auto")
    else:
        mode = "thread" if config.endswith("threads") else "process"
        loader = FastLoader(dataset, worker_mode=mode, **kwargs)
    rates = []
    for epoch in range(epochs + 1):
        start, images = time.perf_counter(), 0
        for batch, _ in loader:
            images += len(batch)
        if epoch:  # the first epoch starts the workers: a warm-up
            rates.append(images / (time.perf_counter() - start))
    return rates


def main() -> None:
    parser = pipeline_parser(__doc__, CONFIGS, batch_size=64)
    parser.add_argument("--data", type=Path, default=None,
                        help="an ImageFolder (default: generate --images into the cache)")
    parser.add_argument("--images", type=int, default=2000)
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
         str(args.batch_size), "--epochs", str(args.epochs)], desc="torchvision pipeline")
    title = (f"torchvision ImageFolder + classic transforms, {root.name}: batch "
             f"{args.batch_size}, {args.workers} workers, median of {args.repeats} runs × "
             f"{args.epochs} epochs")
    print_ratio_table(title, rates, json_path=args.json)


if __name__ == "__main__":
    main()
