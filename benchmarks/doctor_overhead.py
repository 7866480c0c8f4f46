"""What ``fastfeed doctor``'s probe costs the loader it watches, in the same run.

The probe (``fastfeed/doctor/probe.py``) is all the doctor adds to a training step: it times
every ``next()`` of the script's loaders (the per-sample profile and the loader-alone runs
happen after the script has stopped). Here one iterator of each loader is drawn from in chunks
of ``--chunk`` batches, alternately through the probe (``Probe.watch``, what the doctor gives
the script) and directly, with no model: the same workers, the same ring, the same moment of a
shared machine's load, so that its drift cancels between neighbouring chunks. The probe's
cost in throughput is one minus the ratio of the samples/s of the two kinds of chunk, the
median over ``--pairs`` pairs of chunks. On a busy machine that ratio scatters by several
percent either way, so the table also gives the probe's own time per batch, measured apart
(the same batch drawn from a list through the probe and directly, 100,000 times), as a share
of a batch's time at the plain throughput: the most it can cost, where the main thread sets
the pace. Loaders: torch's DataLoader and FastLoader, 2 workers, batches of
64 uint8 3×224×224 images (16 made once and cycled: cheap to index, so the loader itself sets
the pace, where a per-batch cost shows most).

    python benchmarks/doctor_overhead.py --pairs 100 --chunk 10 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastfeed import FastLoader
from fastfeed.doctor.probe import Probe, Window
from fastfeed.progress import progress

NEVER_CLOSES = Window(warmup=0, batches=10**9, seconds=float("inf"))


class Images(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = [torch.randint(0, 256, (3, 224, 224), generator=g, dtype=torch.uint8)
                       for _ in range(16)]

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i % 16], i % 1000


LOADERS: dict[str, Callable[[], DataLoader]] = {
    "DataLoader": lambda: DataLoader(Images(), batch_size=64, num_workers=2),
    "FastLoader": lambda: FastLoader(Images(), batch_size=64, num_workers=2),
}


def _chunk_rate(batches: Iterator[Any], count: int) -> float:
    start = time.perf_counter()
    samples = sum(len(next(batches)[1]) for _ in range(count))
    return samples / (time.perf_counter() - start)


def paired_rates(build: Callable[[], DataLoader], pairs: int, chunk: int
                 ) -> list[tuple[float, float]]:
    """``(plain, probed)`` samples/s of neighbouring chunks of one iterator, the probe first in
    every other pair."""
    loader = build()
    plain = iter(loader)
    probed = Probe(NEVER_CLOSES).watch(loader, plain)
    _chunk_rate(plain, 2 * chunk)  # workers started, queues full
    rates = []
    for pair in range(pairs):
        first, second = (plain, probed) if pair % 2 == 0 else (probed, plain)
        a, b = _chunk_rate(first, chunk), _chunk_rate(second, chunk)
        rates.append((a, b) if pair % 2 == 0 else (b, a))
    del probed, plain
    return rates


def probe_us(batches: int = 100_000) -> float:
    """The probe's own time per ``next()``: the same batch (64 images and their labels) drawn
    from a list, through the probe and directly; median of 5 differences, microseconds."""
    loader = DataLoader(Images(), batch_size=64)  # what the probe reads of it: batching on
    batch = (torch.zeros(64, 3, 224, 224, dtype=torch.uint8), torch.zeros(64, dtype=torch.long))
    items = [batch] * batches

    def seconds(iterator: Iterator[Any]) -> float:
        start = time.perf_counter()
        for _ in iterator:
            pass
        return time.perf_counter() - start

    added = [seconds(Probe(NEVER_CLOSES).watch(loader, iter(items))) - seconds(iter(items))
             for _ in range(5)]
    return statistics.median(added) / batches * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--chunk", type=int, default=10, help="batches per chunk")
    parser.add_argument("--apart", type=int, default=100_000,
                        help="batches for the probe's own time, measured apart")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    cost_us = probe_us(args.apart)
    for name in progress(LOADERS, total=len(LOADERS), desc="doctor overhead"):
        pairs = paired_rates(LOADERS[name], args.pairs, args.chunk)
        ratios = sorted(probed / plain for plain, probed in pairs)
        plain = statistics.median(p for p, _ in pairs)
        results[name] = {"plain": plain, "probed": statistics.median(q for _, q in pairs),
                         "cost_percent": 100 * (1 - statistics.median(ratios)),
                         "ratio_quartiles": statistics.quantiles(ratios, n=4),
                         "probe_share_percent": 100 * cost_us * 1e-6 * plain / 64,
                         "pairs": pairs}
    print(f"| loader | samples/s, plain | samples/s, probed | throughput cost (median of "
          f"{args.pairs} pairs of {args.chunk}-batch chunks; ratios' quartiles) | the probe's "
          f"{cost_us:.1f} µs per batch, as a share of a batch's time |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        low, _, high = r["ratio_quartiles"]
        print(f"| {name} | {r['plain']:,.0f} | {r['probed']:,.0f} | {r['cost_percent']:+.2f} % "
              f"({low:.3f}–{high:.3f}) | {r['probe_share_percent']:.2f} % |")
    if args.json is not None:
        args.json.write_text(json.dumps({"loaders": results, "probe_us_per_batch": cost_us},
                                        indent=2))


if __name__ == "__main__":
    main()
