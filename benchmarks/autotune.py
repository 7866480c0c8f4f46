"""num_workers="auto" against fixed worker counts, and threads against processes.

Three synthetic datasets with a known per-sample cost:

- ``light``: 0.1 ms of Python per sample;
- ``medium``: about 2 ms of zlib compression per sample (releases the GIL, like decoding);
- ``heavy``: 10 ms of Python per sample (holds the GIL).

The consumer simulates a GPU step of ``--step-ms``. Each configuration runs ``--batches``
batches on a fresh loader; throughput is measured over the last ``--measure`` of them, after
"auto" has had 200 batches to settle. Configurations are interleaved over ``--repeats`` and the
medians reported, with "auto" as a ratio of the best fixed setting.

    python benchmarks/autotune.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastfeed import FastLoader
from fastfeed.progress import progress

PAYLOAD = os.urandom(1 << 16) * 4  # 256 KiB: about 2 ms of zlib level 6 here


def python_work(ms: float) -> None:
    """Burn ``ms`` of this thread's CPU time in Python (not wall time: more workers than
    cores must not look free)."""
    end = time.thread_time() + ms / 1000
    x = 0
    while time.thread_time() < end:
        x += 1


class Synthetic(Dataset):
    def __init__(self, kind: str, length: int = 100_000) -> None:
        self.kind, self.length = kind, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.kind == "light":
            python_work(0.1)
        elif self.kind == "medium":
            zlib.compress(PAYLOAD, 6)
        else:
            python_work(10.0)
        return torch.full((3, 32, 32), i % 255, dtype=torch.uint8)


BATCH = {"light": 32, "medium": 8, "heavy": 2}


def run(kind: str, workers: int | str, mode: str, args: argparse.Namespace) -> dict:
    loader = FastLoader(Synthetic(kind), batch_size=BATCH[kind], num_workers=workers,
                        worker_mode=mode if workers != 0 else "process")
    iterator = iter(loader)
    start = None
    for i in range(args.batches):
        if i == args.batches - args.measure:
            start = time.perf_counter()
        next(iterator)
        time.sleep(args.step_ms / 1000)  # the simulated GPU step
    assert start is not None
    rate = args.measure / (time.perf_counter() - start)
    settled = loader.num_workers
    decisions = loader.stats().decisions
    del iterator
    return {"batches_per_s": rate, "workers": settled, "decisions": decisions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=["light", "medium", "heavy"])
    parser.add_argument("--fixed", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--batches", type=int, default=260)
    parser.add_argument("--measure", type=int, default=60)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    configs = [(kind, w, "process") for kind in args.kinds for w in [*args.fixed, "auto"]]
    configs += [(kind, w, "thread") for kind in args.kinds for w in (2, "auto")]
    jobs = [(r, c) for r in range(args.repeats) for c in (configs if r % 2 == 0 else configs[::-1])]
    results: dict[tuple, list[dict]] = {c: [] for c in configs}
    for _, config in progress(jobs, total=len(jobs), desc="runs"):
        results[config].append(run(*config, args))

    summary = []
    print(f"\nstep {args.step_ms} ms; batches/s over batches {args.batches - args.measure}-"
          f"{args.batches}; medians of {args.repeats}\n")
    print("| dataset | mode | workers | batches/s | settled workers |")
    print("|---|---|---|---|---|")
    for (kind, workers, mode), runs in results.items():
        rate = statistics.median(r["batches_per_s"] for r in runs)
        settled = statistics.median(r["workers"] for r in runs)
        summary.append({"kind": kind, "workers": workers, "mode": mode, "batches_per_s": rate,
                        "settled": settled, "decisions": runs[0]["decisions"]})
        print(f"| {kind} | {mode} | {workers} | {rate:.1f} | {settled:g} |")
    print("\n| dataset | best fixed (process) | auto | auto / best |")
    print("|---|---|---|---|")
    for kind in args.kinds:
        fixed = [s for s in summary if s["kind"] == kind and s["mode"] == "process"
                 and s["workers"] != "auto"]
        best = max(fixed, key=lambda s: s["batches_per_s"])
        auto = next(s for s in summary if s["kind"] == kind and s["mode"] == "process"
                    and s["workers"] == "auto")
        print(f"| {kind} | {best['workers']} workers, {best['batches_per_s']:.1f} "
              f"| {auto['batches_per_s']:.1f} ({auto['settled']:g} workers) "
              f"| **{auto['batches_per_s'] / best['batches_per_s']:.2f}** |")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
