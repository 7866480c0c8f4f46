"""A training loop that records what it sees, for the doctor's tests.

Writes one line per batch (a hash of its bytes) to ``--out``, flushed as it goes, and each
worker's pid to ``--out`` + ``.pids``; the dataset draws torch, Python and numpy random numbers
in the workers, so a doctor that disturbed seeding or batches would change the lines.
``--fail-after N`` raises after N batches; ``--mode`` makes it misbehave before any batch:
``fail`` (an exception), ``exit`` (``sys.exit(3)``) or ``no-loader`` (ends without one).
"""

import argparse
import functools
import hashlib
import os
import random
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class Noisy(Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, i):
        jitter = torch.rand(4) + random.random() + float(np.random.rand())
        return torch.arange(4, dtype=torch.float32) * i + jitter, i


def record_pid(path, worker_id):
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--fail-after", type=int, default=None)
    parser.add_argument("--mode", choices=["train", "fail", "exit", "no-loader"], default="train")
    args = parser.parse_args()
    if args.mode == "fail":
        raise ValueError("the data directory is empty")
    if args.mode == "exit":
        sys.exit(3)
    if args.mode == "no-loader":
        print("nothing to train")
        return
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    loader = DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=args.workers,
                        worker_init_fn=functools.partial(record_pid, args.out + ".pids"))
    seen = 0
    with open(args.out, "w") as out:
        for _ in range(args.epochs):
            for values, labels in loader:
                digest = hashlib.sha256(values.numpy().tobytes() + labels.numpy().tobytes())
                out.write(digest.hexdigest() + "\n")
                out.flush()
                seen += 1
                if seen == args.fail_after:
                    raise RuntimeError(f"diverged after {seen} batches")


if __name__ == "__main__":
    main()
