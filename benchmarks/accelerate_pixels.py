"""How far ``fastfeed.vision.accelerate``'s pixels are from the user's own torchvision pipeline.

Each image of an ImageFolder goes through ``RandomResizedCrop(size)`` then ``PILToTensor``,
once the stock way and once accelerated, with the same seed (so the same crop window and
flip). The table gives, per size, the mean absolute difference in grey levels over all
items and seeds, the share of items whose mean exceeds 2, the worst item and the worst pixel.
Use sharp real photos: smooth synthetic images hide what a reduced-scale JPEG decode loses.
Accuracy only: nothing here is timed.

    .venv-clients/bin/python benchmarks/accelerate_pixels.py --data photos/ --seeds 40
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="an ImageFolder root")
    parser.add_argument("--sizes", default="224,160,128")
    parser.add_argument("--seeds", type=int, default=40)
    args = parser.parse_args()

    from torchvision import datasets
    from torchvision import transforms as T

    from fastfeed.progress import progress
    from fastfeed.vision.accelerate import accelerate

    print(f"{args.data}: RandomResizedCrop, PILToTensor; {args.seeds} seeds per image")
    print("| size | mean (grey levels) | items above 2 | worst item | worst pixel |\n"
          "|---|---|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        stock = datasets.ImageFolder(str(args.data), transform=T.Compose([
            T.RandomResizedCrop(size), T.PILToTensor()]))
        fast = accelerate(stock)
        means, worst_pixel = [], 0.0
        for seed in progress(range(args.seeds), total=args.seeds, desc=f"size {size}"):
            for index in range(len(stock)):
                torch.manual_seed(1000 * seed + index)
                expected, _ = stock[index]
                torch.manual_seed(1000 * seed + index)
                got, _ = fast[index]
                difference = (expected.float() - got.float()).abs()
                means.append(difference.mean().item())
                worst_pixel = max(worst_pixel, difference.max().item())
        items = np.array(means)
        print(f"| {size} | {items.mean():.2f} | {(items > 2).mean():.0%} | {items.max():.2f} | "
              f"{worst_pixel:.0f} |")


if __name__ == "__main__":
    main()
