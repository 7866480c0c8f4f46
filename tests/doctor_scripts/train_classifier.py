"""A stock torchvision classification script, for the doctor (client tests, GPU suite).

torchvision's ``ImageFolder`` with the classic train transforms, as ``Compose`` v1 or v2, torch's
own DataLoader, a torchvision model. ``--slow-ms`` adds a transform that sleeps (the tests'
deliberately costly stage); ``--generate N`` makes a generated ImageNet-like folder.

    python train_classifier.py --generate 2000 --arch resnet50 --device cuda --workers 8
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torchvision
from torch import nn
from torch.utils.data import DataLoader

from fastfeed.vision.synthetic import make_imagefolder


class Sleep:
    """Stands in for a costly augmentation."""

    def __init__(self, ms):
        self.seconds = ms / 1000

    def __call__(self, image):
        time.sleep(self.seconds)
        return image


def transforms(version, size, slow_ms):
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    slow = [Sleep(slow_ms)] if slow_ms else []
    if version == "v1":
        from torchvision import transforms as T

        return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                          *slow, T.Normalize(mean, std)])
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(),
                       v2.ToImage(), v2.ToDtype(torch.float32, scale=True), *slow,
                       v2.Normalize(mean, std)])


def model_for(arch, classes):
    if arch == "tiny":
        return nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(8, classes))
    return torchvision.models.__dict__[arch](num_classes=classes)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path)
    parser.add_argument("--generate", type=int, default=64)
    parser.add_argument("--transforms", choices=["v1", "v2"], default="v1")
    parser.add_argument("--slow-ms", type=float, default=0.0)
    parser.add_argument("--arch", default="tiny")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    root = args.data or make_imagefolder(Path(tempfile.mkdtemp()) / "train", args.generate, 4)
    dataset = torchvision.datasets.ImageFolder(
        str(root), transform=transforms(args.transforms, args.size, args.slow_ms))
    device = torch.device(args.device)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                        num_workers=args.workers, pin_memory=device.type == "cuda",
                        drop_last=True)
    model = model_for(args.arch, len(dataset.classes)).to(device)
    model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(args.epochs):
        for step, (images, targets) in enumerate(loader):
            images = images.to(device, non_blocking=True).contiguous(
                memory_format=torch.channels_last)
            targets = targets.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16,
                                enabled=device.type == "cuda"):
                loss = nn.functional.cross_entropy(model(images), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % 10 == 0:
                print(f"epoch {epoch} step {step}: loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
