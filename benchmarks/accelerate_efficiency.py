"""How much of the one-core rate of an accelerated dataset the loader keeps (issue 24, part 1).

The dataset is torchvision's ``ImageFolder`` with the classic ImageNet train transforms
(RandomResizedCrop 224, flip, ToTensor, Normalize) through ``fastfeed.vision.accelerate``.
Configurations, each in a fresh process (one warm-up epoch, then ``--epochs`` timed ones):

- ``plain-float`` / ``plain-uint8``: one core (one torch thread), a plain loop over a shuffled
  epoch, ``dataset[i]`` only (no collate): the float items the user's transform gives, and the
  same items stopped at uint8 (``defer_tail=True``). The per-core limit.
- ``fastfeed-1w`` / ``fastfeed-2w``: ``FastLoader`` over the accelerated dataset, 1 or 2 worker
  processes, float batches (the tail runs on whole batches, into the pool slot).
- ``per-sample-1w`` / ``per-sample-2w``: the same with a ``collate_fn`` that only calls
  ``default_collate``, which keeps FastLoader from splitting off the tail: each item is a float
  tensor, collated afterwards (what FastLoader did before).
- ``uint8-2w``: uint8 batches (``defer_tail=True``), 2 workers.
- ``stock``: torch's ``DataLoader`` with torchvision's own transforms, 2 workers.

Batch 64, shuffled, persistent workers. The table gives medians over every timed epoch of
every repeat, the ratio to ``stock``, and each loader row against ``workers × plain`` (the
per-core limit). ``--images 320`` gives the short epochs of the issue (5 batches).

    .venv-clients/bin/python benchmarks/accelerate_efficiency.py --images 600 --repeats 3
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.interleaved import interleaved_rates, pipeline_parser, print_ratio_table

CONFIGS = ("stock", "plain-float", "plain-uint8", "per-sample-1w", "fastfeed-1w",
           "per-sample-2w", "fastfeed-2w", "uint8-2w")


def collate_per_sample(samples: list) -> Any:
    """``default_collate``, under another name: FastLoader then keeps the per-sample tail."""
    from torch.utils.data import default_collate

    return default_collate(samples)


def plain_loop(dataset: Any, epochs: int) -> list[float]:
    import torch

    torch.set_num_threads(1)  # as in a worker
    generator = torch.Generator().manual_seed(0)
    rates = []
    for epoch in range(epochs + 1):
        order = torch.randperm(len(dataset), generator=generator).tolist()
        start = time.perf_counter()
        for index in order:
            dataset[index]
        if epoch:
            rates.append(len(order) / (time.perf_counter() - start))
    return rates


def epochs_per_s(config: str, root: Path, batch_size: int, epochs: int,
                 epoch_samples: int | None = None) -> list[float]:
    """Images/s of each timed epoch of ``config``; ``epoch_samples`` draws epochs of that many
    random images (``RandomSampler(num_samples=...)``) instead of shuffling the whole set."""
    from torch.utils.data import DataLoader, RandomSampler

    from benchmarks.torchvision_pipeline import timed_epochs
    from fastfeed import FastLoader
    from fastfeed.bench.data import classic_imagefolder
    from fastfeed.vision.accelerate import accelerate

    stock = classic_imagefolder(root)
    order = ({"sampler": RandomSampler(stock, num_samples=epoch_samples)} if epoch_samples
             else {"shuffle": True})
    if config == "stock":
        return timed_epochs(DataLoader(stock, batch_size=batch_size, num_workers=2,
                                       persistent_workers=True, **order), epochs)
    uint8 = config.endswith("uint8") or config.startswith("uint8")
    dataset = accelerate(stock, defer_tail=uint8)
    if config.startswith("plain"):
        return plain_loop(dataset, epochs)
    workers = int(config.rsplit("-", 1)[1].rstrip("w"))
    extra = {"collate_fn": collate_per_sample} if config.startswith("per-sample") else {}
    loader = FastLoader(dataset, batch_size=batch_size, num_workers=workers,
                        persistent_workers=True, **order, **extra)
    return timed_epochs(loader, epochs)


def print_against_plain(medians: dict[str, float]) -> None:
    """Each loader row against ``workers ×`` the one-core rate of the items it reads."""
    print("\n| loader | of workers × one core |\n|---|---|")
    for config, rate in medians.items():
        if config == "stock" or config.startswith("plain"):
            continue
        workers = int(config.rsplit("-", 1)[1].rstrip("w"))
        plain = medians.get("plain-uint8" if config.startswith("uint8") else "plain-float")
        if plain:
            print(f"| {config} | {rate / (workers * plain):.0%} |")


def main() -> None:
    parser = pipeline_parser(__doc__, CONFIGS, batch_size=64)
    parser.add_argument("--images", type=int, default=600)
    args = parser.parse_args()

    from fastfeed.bench.data import CACHE
    from fastfeed.vision.synthetic import make_imagefolder

    root = CACHE / f"imagenet-like-{args.images}"
    if args.one:
        print(json.dumps(epochs_per_s(args.one, root, args.batch_size, args.epochs)))
        return
    if not root.exists():
        make_imagefolder(root, args.images, classes=50)
    load_before = os.getloadavg()
    rates = interleaved_rates(__file__, args.configs.split(","), args.repeats,
                              ["--images", str(args.images), "--batch-size",
                               str(args.batch_size), "--epochs", str(args.epochs)],
                              desc="accelerate efficiency")
    load_after = os.getloadavg()
    medians = print_ratio_table(
        f"accelerate efficiency, {root.name}: batch {args.batch_size}, median of "
        f"{args.repeats} runs × {args.epochs} epochs", rates, json_path=args.json)
    print_against_plain(medians)
    spreads = {c: f"{min(r):,.0f}–{max(r):,.0f}" for c, r in rates.items()}
    print("\nspread (min–max): " + ", ".join(f"{c} {s}" for c, s in spreads.items()))
    print(f"load average (1 min) {load_before[0]:.1f} before, {load_after[0]:.1f} after, on "
          f"{os.cpu_count()} cores")


if __name__ == "__main__":
    main()
