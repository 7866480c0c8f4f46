"""What loader telemetry costs per batch: the counters a batch updates, timed in a loop.

    python benchmarks/telemetry_cost.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastfeed.telemetry import Telemetry, batch_length


def per_batch_us(batches: int = 200_000) -> float:
    telemetry = Telemetry()
    batch = (torch.zeros(128, 3, 4, 4, dtype=torch.uint8), torch.zeros(128))
    start = time.perf_counter()
    for _ in range(batches):  # what one delivered batch records, in the pool iterator
        requested = time.perf_counter()
        telemetry.add_stage("fetch", 0.001)
        telemetry.add_stage("collate", 0.001)
        telemetry.add_worker_busy(0.002)
        telemetry.skipped += 0
        telemetry.delivered(requested, batch_length(batch, auto_collation=True))
    return (time.perf_counter() - start) / batches * 1e6


if __name__ == "__main__":
    runs = [per_batch_us() for _ in range(5)]
    print(f"telemetry per batch: {statistics.median(runs):.2f} µs (median of 5)")
