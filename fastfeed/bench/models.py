"""Models for ``--model``: a real training step on the device."""

from __future__ import annotations

import torch
from torch import nn

from fastfeed import transforms as T

__all__ = ["TrainStep", "build_model", "yolo_like"]


def yolo_like(classes: int = 80) -> nn.Module:
    """A small strided conv net in the shape of a YOLO backbone and head."""
    layers: list[nn.Module] = []
    channels = 3
    for width in (16, 32, 64, 128, 256):
        layers += [nn.Conv2d(channels, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width),
                   nn.SiLU(), nn.Conv2d(width, width, 3, 1, 1, bias=False),
                   nn.BatchNorm2d(width), nn.SiLU()]
        channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)]
    return nn.Sequential(*layers)


def tiny(classes: int = 1000) -> nn.Module:
    """A model that costs almost nothing: for testing the benchmark itself on a CPU."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, classes))


def build_model(name: str, classes: int = 1000) -> nn.Module:
    if name == "resnet50":
        import torchvision  # optional: only this model needs it

        return torchvision.models.resnet50(num_classes=classes)
    if name == "yolo-like":
        return yolo_like(classes)
    if name == "tiny":
        return tiny(classes)
    raise ValueError(f"unknown model {name!r}: resnet50, yolo-like or tiny")


class TrainStep:
    """Forward, backward and SGD on images (uint8 or float), with AMP and channels_last on
    CUDA; labels are synthetic, since only the step's cost matters here."""

    def __init__(self, name: str, device: torch.device, classes: int = 1000) -> None:
        self.device = device
        self.model = build_model(name, classes).to(device)
        self.model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.normalize = T.Normalize()
        self.classes = classes

    def step(self, images: torch.Tensor) -> None:
        images = images.to(self.device, non_blocking=True)
        if images.dtype == torch.uint8:
            images = self.normalize(images)
        images = images.contiguous(memory_format=torch.channels_last)
        labels = torch.randint(0, self.classes, (images.shape[0],), device=self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.device.type == "cuda"):
            loss = nn.functional.cross_entropy(self.model(images), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
