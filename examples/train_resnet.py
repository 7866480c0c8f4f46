"""A torchvision-style classification training script, fed by fastfeed.

The only change from the stock script is the import marked below. Run on real data:

    python examples/train_resnet.py --data imagenet/train --device cuda --workers 8

or, on any machine, on a tiny generated set:

    python examples/train_resnet.py --generate 64 --epochs 1 --device cpu
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

# from torch.utils.data import DataLoader
from fastfeed import FastLoader as DataLoader  # the one-line swap
from fastfeed.vision import ImageCollate, ImageFolder
from fastfeed.vision.synthetic import make_imagefolder


def build_model(arch: str, classes: int) -> nn.Module:
    try:
        import torchvision

        return torchvision.models.__dict__[arch](num_classes=classes)
    except ImportError:  # no torchvision here: a small CNN stands in
        return nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU(),
                             nn.Conv2d(32, 64, 3, 2, 1), nn.BatchNorm2d(64), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path)
    parser.add_argument("--generate", type=int, default=0, help="make a tiny set of N images")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.generate:
        args.data = make_imagefolder(Path(tempfile.mkdtemp()) / "train", args.generate, 4)
    if args.data is None:
        parser.error("--data or --generate is required")

    device = torch.device(args.device)
    dataset = ImageFolder(args.data, size=args.size)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                        num_workers=args.workers, pin_memory=device.type == "cuda",
                        collate_fn=ImageCollate(), drop_last=True,
                        persistent_workers=args.workers > 0)
    model = build_model(args.arch, len(dataset.classes)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255

    for epoch in range(args.epochs):
        model.train()
        start, seen = time.perf_counter(), 0
        for images, targets in loader:
            images = images.to(device, non_blocking=True).float().sub_(mean).div_(std)
            targets = targets.to(device, non_blocking=True)
            loss = nn.functional.cross_entropy(model(images), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += len(targets)
        rate = seen / (time.perf_counter() - start)
        print(f"epoch {epoch}: loss {loss.item():.3f}, {rate:.0f} images/s")
    print(loader.stats() if hasattr(loader, "stats") else "")


if __name__ == "__main__":
    main()
