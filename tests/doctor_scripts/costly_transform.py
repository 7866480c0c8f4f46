"""A data-bound training script for the doctor's tests: one transform of its pipeline sleeps.

A plain PyTorch loop over a dataset of generated images, with a pipeline shaped like
torchvision's ``Compose`` (a list in ``.transforms``); ``SlowBlur`` sleeps 40 ms per sample and
the rest cost microseconds, so the doctor must name ``SlowBlur`` first and call the run
data-bound. The margin holds on a loaded machine: two workers deliver a batch every 160 ms,
while the model step, on one intra-op thread, takes about a millisecond: for training to wait
less than 15 % of each step, it would have to take 136 ms.

    python costly_transform.py [--workers 2] [--epochs 3]
"""

import argparse
import time

import torch
from torch.utils.data import DataLoader, Dataset


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, image):
        for transform in self.transforms:
            image = transform(image)
        return image


class ToFloat:
    def __call__(self, image):
        return image.float() / 255


class SlowBlur:
    def __call__(self, image):
        time.sleep(0.04)
        return image


class Flip:
    def __call__(self, image):
        return image.flip(-1) if torch.rand(()) < 0.5 else image


class Images(Dataset):
    def __init__(self, n, transform):
        self.n, self.transform = n, transform

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        image = torch.randint(0, 256, (3, 16, 16), generator=g, dtype=torch.uint8)
        return self.transform(image), i % 10


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a tiny model: split across busy cores, each op waits for one
    dataset = Images(96, Compose([ToFloat(), SlowBlur(), Flip()]))
    loader = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=args.workers)
    model = torch.nn.Linear(3 * 16 * 16, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        for images, labels in loader:
            loss = torch.nn.functional.cross_entropy(model(images.flatten(1)), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch}: loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
