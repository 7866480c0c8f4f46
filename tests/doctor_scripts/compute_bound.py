"""A compute-bound training script for the doctor's tests: the step, not the data, is slow.

Cheap generated tensors from two workers; each step sleeps 200 ms, standing in for a model step
that keeps the host busy (as a GPU step does when the loop reads its loss). The loader is
hundreds of times faster than the loop: the doctor must say compute-bound and offer nothing.
"""

import time

import torch
from torch.utils.data import DataLoader, Dataset


class Tensors(Dataset):
    def __len__(self):
        return 512

    def __getitem__(self, i):
        return torch.full((3, 8, 8), i % 255, dtype=torch.uint8), i % 10


def main():
    loader = DataLoader(Tensors(), batch_size=16, shuffle=True, num_workers=2)
    for epoch in range(2):
        for _batch in loader:
            time.sleep(0.2)  # the model step
        print(f"epoch {epoch} done")


if __name__ == "__main__":
    main()
