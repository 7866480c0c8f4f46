"""The classic torchvision ImageNet training script, with fastfeed's two lines.

Everything is torchvision's own (``ImageFolder``, the train transforms, the model); the two
marked lines swap the loader and accelerate the dataset. Run on real data:

    python examples/train_torchvision.py --data imagenet/train --device cuda --workers 8

or, on any machine with torchvision, on a tiny generated set:

    python examples/train_torchvision.py --generate 64 --epochs 1 --device cpu --arch resnet18
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torchvision
from torch import nn
from torchvision import transforms as T

# from torch.utils.data import DataLoader
from fastfeed import FastLoader as DataLoader  # 1: the import swap
from fastfeed.vision import accelerate
from fastfeed.vision.synthetic import make_imagefolder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path)
    parser.add_argument("--generate", type=int, default=0, help="make a tiny set of N images")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.generate:
        args.data = make_imagefolder(Path(tempfile.mkdtemp()) / "train", args.generate, 4)
    if args.data is None:
        parser.error("--data or --generate is required")

    device = torch.device(args.device)
    train = torchvision.datasets.ImageFolder(str(args.data), transform=T.Compose([
        T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]))
    train = accelerate(train)  # 2: same classes, labels, order and random crops, decoded faster
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True,
                        num_workers=args.workers, pin_memory=device.type == "cuda",
                        drop_last=True, persistent_workers=args.workers > 0)
    model = torchvision.models.__dict__[args.arch](num_classes=len(train.classes)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)

    for epoch in range(args.epochs):
        model.train()
        start, seen = time.perf_counter(), 0
        for images, targets in loader:
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            loss = nn.functional.cross_entropy(model(images), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += len(targets)
        rate = seen / (time.perf_counter() - start)
        print(f"epoch {epoch}: loss {loss.item():.3f}, {rate:.0f} images/s")
    print(loader.stats())


if __name__ == "__main__":
    main()
