"""A training script whose stages have known costs, for the doctor's figures on a busy machine.

The dataset applies a plain list of four transforms, one of each kind a list holds: a function
(``random_crop``), a lambda, a ``functools.partial`` (of ``hflip``) and a callable object
(``Normalize``). Each is a busy loop of a fixed number of Python steps, so its cost is the
same in a worker as anywhere on one core. The collate is made of many small tensor ops, each
large enough for torch to split it between intra-op threads: on one thread, as in a worker,
it costs about a millisecond; split on cores that another process keeps busy, each op waits
for a core, and the whole takes several times longer.

The test imports this file and times each stage itself (``STAGES``, ``collate``) to compare
with what the doctor reports.

    python known_costs.py [--epochs 3]
"""

import argparse
import functools

import torch
from torch.utils.data import DataLoader, Dataset

BATCH = 8
SAMPLE = 5000  # floats: a batch is 40,000, above the size torch splits an op at (32,768)


def spin(steps):
    total = 0
    for step in range(steps):
        total += step
    return total


def random_crop(x):
    spin(40_000)
    return x


def hflip(x, steps):
    spin(steps)
    return x


class Normalize:
    def __call__(self, x):
        spin(20_000)
        return x


STAGES = [random_crop, lambda x: spin(30_000) and x, functools.partial(hflip, steps=25_000),
          Normalize()]


def collate(samples):
    batch = torch.stack(samples)
    for _ in range(400):
        batch.mul_(1.0001)
    return batch


class Signals(Dataset):
    def __init__(self, transforms):
        self.transforms = transforms

    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.full((SAMPLE,), float(i))
        for transform in self.transforms:
            x = transform(x)
        return x


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    # A lambda does not pickle: workers started by pickling the dataset (forkserver, Python
    # 3.14's default on Linux, or spawn) could not get it, so this script forks them.
    loader = DataLoader(Signals(STAGES), batch_size=BATCH, shuffle=True, num_workers=2,
                        collate_fn=collate, multiprocessing_context="fork")
    weight = torch.zeros(SAMPLE)
    for epoch in range(args.epochs):
        for batch in loader:
            weight += batch.mean(0)
        print(f"epoch {epoch}: {float(weight.sum()):.3f}")


if __name__ == "__main__":
    main()
