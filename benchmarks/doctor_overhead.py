"""What ``fastfeed doctor``'s probe costs the loader it watches, in the same run.

The probe (``fastfeed/doctor/probe.py``) is all the doctor adds to a training step: it wraps
each loader's iterator and times every ``next()``; the per-sample profile and the loader-alone
runs happen after the script has stopped. Here each loader is iterated with no model, probe
off and probe on in back-to-back pairs (the probe first in every other pair), ``--batches``
batches a run; the probe's cost is one minus the median of the pairs' throughput ratios (a
shared machine's load drifts between pairs far more than within one). Loaders: torch's DataLoader
and FastLoader, 2 workers, batches of 64 uint8 3×224×224 images (16 made once and cycled:
cheap to index, so that the loader, not a dataset, sets the pace, which is where a per-batch
cost shows most). A last line gives the probe's own cost per ``next()`` on a loader without
workers over a list (a diagnostic: microseconds, not a share).

    python benchmarks/doctor_overhead.py --repeats 15 --batches 300 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastfeed import FastLoader
from fastfeed.doctor.probe import Probe, Window
from fastfeed.progress import progress


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


def rate(build: Callable[[], DataLoader], batches: int, probed: bool, warmup: int = 10) -> float:
    """Samples/s over ``batches`` batches after ``warmup``, with or without the probe."""
    probe = Probe(Window(warmup=0, batches=10**9, seconds=float("inf")))
    if probed:
        probe.install()
    try:
        iterator = iter(build())
        for _ in range(warmup):
            next(iterator)
        start = time.perf_counter()
        samples = sum(len(next(iterator)[1]) for _ in range(batches))
        elapsed = time.perf_counter() - start
        del iterator
    finally:
        probe.uninstall()
    return samples / elapsed


def per_next_us(batches: int = 100_000) -> tuple[float, float]:
    """Microseconds per ``next()`` over a list, without and with the probe (medians of 5)."""
    def once(probed: bool) -> float:
        loader = DataLoader(list(range(batches)), batch_size=None)
        probe = Probe(Window(warmup=0, batches=10**9, seconds=float("inf")))
        if probed:
            probe.install()
        try:
            start = time.perf_counter()
            for _ in loader:
                pass
            return (time.perf_counter() - start) / batches * 1e6
        finally:
            probe.uninstall()

    runs = [(once(False), once(True)) for _ in range(5)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    # Pairs, back to back (probe first in every other pair): a shared machine's load drifts
    # over a minute, much less between the two runs of a pair, so each pair gives a ratio.
    jobs = [(name, r) for r in range(args.repeats) for name in LOADERS]
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in LOADERS}
    for name, r in progress(jobs, total=len(jobs), desc="doctor overhead"):
        first, second = (rate(LOADERS[name], args.batches, probed) for probed in (r % 2, 1 - r % 2))
        runs[name].append((first, second) if r % 2 == 0 else (second, first))
    print(f"| loader | samples/s, plain | samples/s, probed | probe's cost (median of the "
          f"{args.repeats} pairs' ratios) | ratios' interquartile range |")
    print("|---|---|---|---|---|")
    results = {}
    for name, pairs in runs.items():
        ratios = sorted(probed / plain for plain, probed in pairs)
        quartiles = statistics.quantiles(ratios, n=4)
        results[name] = {"plain": statistics.median(p for p, _ in pairs),
                         "probed": statistics.median(q for _, q in pairs),
                         "cost_percent": 100 * (1 - statistics.median(ratios)),
                         "ratios": ratios}
        print(f"| {name} | {results[name]['plain']:,.0f} | {results[name]['probed']:,.0f} | "
              f"{results[name]['cost_percent']:+.2f} % | {quartiles[0]:.3f}–{quartiles[2]:.3f} |")
    bare, probed_us = per_next_us()
    print(f"diagnostic: next() over a list without workers, {bare:.2f} µs plain, "
          f"{probed_us:.2f} µs probed: {probed_us - bare:.2f} µs per batch")
    if args.json is not None:
        args.json.write_text(json.dumps({"loaders": results,
                                         "per_next_us": {"plain": bare, "probed": probed_us}},
                                        indent=2))


if __name__ == "__main__":
    main()
