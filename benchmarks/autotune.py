"""num_workers="auto" against fixed worker counts, and threads against processes.

Four synthetic datasets with a known per-sample cost:

- ``light``: 0.1 ms of Python per sample;
- ``medium``: about 2 ms of zlib compression per sample (releases the GIL, like decoding);
- ``heavy``: 10 ms of Python per sample (holds the GIL);
- ``io``: 0.5 ms of Python and 6 ms waiting on storage (a sleep, as a network file system or
  an object store read), where more workers than cores pay.

The consumer simulates a GPU step of ``--step-ms``. Each configuration runs ``--batches``
batches on a fresh loader; throughput is measured over the last ``--measure`` of them, after
"auto" has had 200 batches to settle. A second table times the first whole epoch of a
10-batch epoch, worker start-up included, for "auto" against ``num_workers=<cores>``: what a
short epoch, or the first of a long run, sees. Configurations are interleaved over
``--repeats`` and the medians reported, with "auto" as a ratio of the best fixed setting.

    python benchmarks/autotune.py
    # the I/O case of issue 24 (batch 8, a 4 ms step), "auto" given 750 batches to climb:
    python benchmarks/autotune.py --kinds io --modes process --step-ms 4 --batches 900 \\
        --measure 150
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
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
        elif self.kind == "io":
            python_work(0.5)
            time.sleep(0.006)
        else:
            python_work(10.0)
        return torch.full((3, 32, 32), i % 255, dtype=torch.uint8)


BATCH = {"light": 32, "medium": 8, "heavy": 2, "io": 8}
FIXED = {"io": [2, 4, 8, 12, 16]}  # the default of --fixed for these kinds; others: 0-4
CORES = len(os.sched_getaffinity(0))


def first_epoch(kind: str, workers: int | str, args: argparse.Namespace) -> float:
    """Batches/s over the whole first epoch of a 10-batch epoch, start-up included."""
    start = time.perf_counter()
    loader = FastLoader(Synthetic(kind, length=10 * BATCH[kind]), batch_size=BATCH[kind],
                        num_workers=workers)
    for _ in loader:
        time.sleep(args.step_ms / 1000)
    return 10 / (time.perf_counter() - start)


def endless(loader: FastLoader):
    while True:
        yield from loader


def run(kind: str, workers: int | str, mode: str, args: argparse.Namespace) -> dict:
    # worker_mode="auto" decides after an epoch in each mode: give it 40-batch epochs.
    length = 40 * BATCH[kind] if mode == "auto" else 100_000
    loader = FastLoader(Synthetic(kind, length), batch_size=BATCH[kind], num_workers=workers,
                        worker_mode=mode if workers != 0 else "process")
    iterator = endless(loader)
    start = None
    for i in range(args.batches):
        if i == args.batches - args.measure:
            start = time.perf_counter()
        next(iterator)
        time.sleep(args.step_ms / 1000)  # the simulated GPU step
    assert start is not None
    rate = args.measure / (time.perf_counter() - start)
    # Where the tuner settled: the last count its decisions name (the start, without any).
    moves = [d.split(" workers:")[0] for d in loader.stats().decisions if " -> " in d]
    settled = int(moves[-1].split(" -> ")[1]) if moves else loader.num_workers
    decisions = loader.stats().decisions
    del iterator
    return {"batches_per_s": rate, "workers": settled, "decisions": decisions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=["light", "medium", "heavy", "io"])
    parser.add_argument("--fixed", nargs="+", type=int, default=None,
                        help="fixed worker counts to compare with (default: 0-4, and for io "
                             + " ".join(map(str, FIXED["io"])) + ")")
    parser.add_argument("--batches", type=int, default=260)
    parser.add_argument("--measure", type=int, default=60)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["process", "thread", "auto"],
                        help="worker modes to run: process (fixed counts and auto), thread "
                             "(cores and auto), auto (worker_mode='auto')")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    # Counts past the cores are the point here: torch's warning about them is noise.
    warnings.filterwarnings("ignore", message="This DataLoader will create")

    configs = [(kind, w, "process") for kind in args.kinds
               for w in [*(args.fixed or FIXED.get(kind, [0, 1, 2, 3, 4])), "auto"]
               if "process" in args.modes]
    configs += [(kind, w, "thread") for kind in args.kinds for w in (CORES, "auto")
                if "thread" in args.modes]
    configs += [(kind, "auto", "auto") for kind in args.kinds if "auto" in args.modes]
    epoch_configs = [(kind, w) for kind in args.kinds for w in (CORES, "auto")]
    jobs = [(r, c) for r in range(args.repeats) for c in (configs if r % 2 == 0 else configs[::-1])]
    results: dict[tuple, list[dict]] = {c: [] for c in configs}
    for _, config in progress(jobs, total=len(jobs), desc="runs"):
        results[config].append(run(*config, args))
    epochs: dict[tuple, list[float]] = {c: [] for c in epoch_configs}
    for _, config in progress([(r, c) for r in range(args.repeats) for c in epoch_configs],
                              total=args.repeats * len(epoch_configs), desc="first epochs"):
        epochs[config].append(first_epoch(*config, args))

    summary = []
    print(f"\nstep {args.step_ms} ms; batches/s over batches {args.batches - args.measure}-"
          f"{args.batches}; medians of {args.repeats}\n")
    print("| dataset | mode | workers | batches/s | min–max | settled workers |")
    print("|---|---|---|---|---|---|")
    for (kind, workers, mode), runs in results.items():
        rates = [r["batches_per_s"] for r in runs]
        rate = statistics.median(rates)
        settled = statistics.median(r["workers"] for r in runs)
        summary.append({"kind": kind, "workers": workers, "mode": mode, "batches_per_s": rate,
                        "rates": rates, "settled": settled,
                        "settled_each": [r["workers"] for r in runs],
                        "decisions": runs[0]["decisions"]})
        print(f"| {kind} | {mode} | {workers} | {rate:.1f} | {min(rates):.1f}–{max(rates):.1f} "
              f"| {settled:g} |")
    print("\n| dataset | best fixed (process) | auto | auto / best |")
    print("|---|---|---|---|")
    for kind in args.kinds if "process" in args.modes else ():
        fixed = [s for s in summary if s["kind"] == kind and s["mode"] == "process"
                 and s["workers"] != "auto"]
        best = max(fixed, key=lambda s: s["batches_per_s"])
        auto = next(s for s in summary if s["kind"] == kind and s["mode"] == "process"
                    and s["workers"] == "auto")
        print(f"| {kind} | {best['workers']} workers, {best['batches_per_s']:.1f} "
              f"| {auto['batches_per_s']:.1f} ({auto['settled']:g} workers) "
              f"| **{auto['batches_per_s'] / best['batches_per_s']:.2f}** |")
    print("\n| dataset | worker_mode='auto' with num_workers='auto' chose |\n|---|---|")
    for kind in args.kinds if "auto" in args.modes else ():
        runs = results[(kind, "auto", "auto")]
        chosen = [d for d in runs[0]["decisions"] if d.startswith("worker_mode auto")]
        print(f"| {kind} | {chosen[0] if chosen else 'undecided'} |")
    print(f"\nfirst epoch of 10 batches, start-up included (batches/s, medians of "
          f"{args.repeats})\n")
    print(f"| dataset | num_workers={CORES} | auto | auto / {CORES} |\n|---|---|---|---|")
    for kind in args.kinds:
        fixed = statistics.median(epochs[(kind, CORES)])
        auto_rate = statistics.median(epochs[(kind, "auto")])
        print(f"| {kind} | {fixed:.1f} | {auto_rate:.1f} | **{auto_rate / fixed:.2f}** |")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "first_epochs": {
            f"{k}/{w}": v for (k, w), v in epochs.items()}}, indent=2))


if __name__ == "__main__":
    main()
