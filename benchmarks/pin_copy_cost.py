"""What `pin_memory=True` costs now that a pool slot is never handed to the user pinned.

With `pin_memory=True` and no `device=`, the user drives the copy to the GPU, and torch guards
only pinned memory it allocated; so fastfeed copies each batch out of its (pageable) pool slot
into torch's pinned pool, as the stock loader's pin thread does (docs/how-it-works.md). This
measures that one host copy per batch: a memcpy into a reused destination (torch's caching host
allocator reuses its blocks), for the batches of the CNN pipelines in RESULTS.md. On a machine
without CUDA the destination is ordinary memory; page-locked memory copies at the same speed.

    python benchmarks/pin_copy_cost.py
"""

from __future__ import annotations

import statistics
import time

import torch

# (name, shape, dtype): a batch of the torchvision ImageNet pipeline, float and uint8, and a
# YOLO batch at imgsz 640.
BATCHES = [
    ("ImageNet float32, 64 x 3 x 224 x 224", (64, 3, 224, 224), torch.float32),
    ("ImageNet uint8, 64 x 3 x 224 x 224", (64, 3, 224, 224), torch.uint8),
    ("YOLO uint8, 16 x 3 x 640 x 640", (16, 3, 640, 640), torch.uint8),
]


def copy_ms(shape: tuple[int, ...], dtype: torch.dtype, repeats: int = 30) -> float:
    """Median milliseconds of one copy of a fresh batch into a reused destination."""
    torch.set_num_threads(1)  # the pin copy runs in the main process, on one thread
    destination = torch.empty(shape, dtype=dtype)
    times = []
    for _ in range(repeats):
        source = torch.empty(shape, dtype=dtype).fill_(1)  # a new batch: cold in the caches
        start = time.perf_counter()
        destination.copy_(source)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    print("| batch | MB | copy ms (median of 30) | GB/s |")
    print("|---|---|---|---|")
    for name, shape, dtype in BATCHES:
        nbytes = torch.empty(shape, dtype=dtype).nbytes
        ms = copy_ms(shape, dtype)
        print(f"| {name} | {nbytes / 1e6:.1f} | {ms:.2f} | {nbytes / ms / 1e6:.1f} |")


if __name__ == "__main__":
    main()
