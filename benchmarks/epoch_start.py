"""Each epoch's start under the forkserver start method (Python 3.14's default on Linux): stock
and fastfeed side by side, at ImageNet scale.

With ``multiprocessing_context=None``, torch's DataLoader starts workers by the platform's
default, which Python 3.14 made ``forkserver`` on Linux. A forkserver worker is a fork of a
clean server process, and receives the dataset pickled; without persistent workers that
happens again at every epoch. The dataset holds 1,281,167 ``(path, class)`` pairs as
torchvision's ``ImageFolder`` holds them (``samples``, ``imgs``, ``targets``), batch 1024,
shuffled, the plain import swap (fastfeed's defaults). Measured, each configuration in a fresh
process, stock and fastfeed alternating:

- **first batch**: seconds from ``iter(loader)`` to the first batch, for each of ``--epochs``
  epochs (each epoch is left after its first batch: what is measured is its start);
- **memory**: each worker's private memory (USS) and proportional share (PSS) at the first
  batch of the last epoch;
- **the floor**: as many bare processes started the same way, each reporting back at once:
  the first time (the server starts too), then again (forked from the running server).

The forkserver imports the script's modules (torch, fastfeed) once, before it forks a worker,
as Python 3.14's does (``--preload none``: as 3.11 to 3.13.0 do, where each worker imports
torch itself).

    python benchmarks/epoch_start.py                    # the full scale: about 10 minutes
    python benchmarks/epoch_start.py --samples 20000 --workers 2 --rounds 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.interleaved import interleaved_rates
from benchmarks.memory_at_scale import IMAGENET_TRAIN, LOADERS, FolderIndex, run_floor


def _memory_mb(pid: int) -> tuple[float, float]:
    """A process's private memory (USS) and proportional share (PSS), in MB."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)

    def kb(key: str) -> int:
        return int(fields[key].split()[0])

    return (kb("Private_Clean") + kb("Private_Dirty")) / 1024, kb("Pss") / 1024


def descendant_workers() -> list[int]:
    """The DataLoader workers below this process, however started: a forkserver's workers are
    the server's children, not this process's (both loaders name them ``pt_data_worker``)."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        parents[int(entry)], names[int(entry)] = int(rest.split()[1]), name

    def below_me(pid: int) -> bool:
        for _ in range(16):
            pid = parents.get(pid, 0)
            if pid == os.getpid():
                return True
            if pid <= 1:
                return False
        return False

    return sorted(p for p, n in names.items() if n == "pt_data_worker" and below_me(p))


def run_epochs(kind: str, workers: int, persistent: bool, args: argparse.Namespace
               ) -> dict[str, Any]:
    """``args.epochs`` epochs' starts of one loader; each epoch is left at its first batch."""
    dataset = FolderIndex(args.samples)
    loader = LOADERS[kind](dataset, batch_size=1024, shuffle=True, num_workers=workers,
                           persistent_workers=persistent,
                           multiprocessing_context=args.context)
    firsts, memory = [], []
    for _ in range(args.epochs):
        started = time.perf_counter()
        iterator = iter(loader)
        next(iterator)
        firsts.append(time.perf_counter() - started)
        pids = descendant_workers()
        while len(pids) < workers:  # a worker that has not sent a batch yet may still start
            time.sleep(0.05)
            pids = descendant_workers()
        memory = [_memory_mb(pid) for pid in pids]
        del iterator  # the epoch ends here: without persistent workers, its workers stop
    return {"first_batch_s": firsts, "uss_mb": [m[0] for m in memory],
            "pss_mb": [m[1] for m in memory]}


def serve_like_python_314(context: str) -> None:
    """Under forkserver, the server imports this script's modules once before it forks any
    worker, as Python 3.14's does; 3.11 to 3.13.0 never give it the main module's path
    (CPython issue 126631), so that each worker would import torch itself at every epoch."""
    if context != "forkserver":
        return
    root = str(Path(__file__).resolve().parents[1])  # the server's sys.path, on 3.11 too
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    multiprocessing.set_forkserver_preload(
        ["__main__", "torch", "fastfeed", "benchmarks.memory_at_scale"])


def child(config: str, args: argparse.Namespace) -> Any:
    if args.preload == "script":
        serve_like_python_314(args.context)
    kind, workers, persistent = config.split(":")
    if kind == "floor":  # the first start includes the server's; later ones fork a warm one
        return [run_floor(args.context, int(workers)), run_floor(args.context, int(workers))]
    return [run_epochs(kind, int(workers), persistent == "persistent", args)]


def report(figures: dict[str, Any], args: argparse.Namespace) -> None:
    def seconds(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"

    print(f"{args.samples:,} (path, class) pairs, batch 1024, shuffled, start method "
          f"{args.context} (the server imports: {args.preload}); torch {torch.__version__}, "
          f"Python {sys.version.split()[0]}, "
          f"{os.cpu_count()} cores, load average before {args.load_before[0]:.1f}, after "
          f"{os.getloadavg()[0]:.1f}; medians of {args.rounds} fresh processes (min–max)")
    print("\n| workers | persistent | epoch | stock s | fastfeed s | fastfeed / stock |"
          " bare processes s |\n|---|---|---|---|---|---|---|")
    for workers in args.workers:
        floors = figures[f"floor:{workers}:-"]
        for persistent in ("fresh", "persistent"):
            runs = {k: figures[f"{k}:{workers}:{persistent}"] for k in LOADERS}
            for epoch in range(args.epochs):
                stock, fast = ([run["first_batch_s"][epoch] for run in runs[k]]
                               for k in LOADERS)
                ratio = statistics.median(fast) / statistics.median(stock)
                floor = floors[0::2] if epoch == 0 else floors[1::2]
                print(f"| {workers} | {'yes' if persistent == 'persistent' else 'no'} | "
                      f"{epoch + 1} | {seconds(stock)} | {seconds(fast)} | **{ratio:.2f}×** | "
                      f"{seconds(floor)} |")
    print("\n| workers | persistent | loader | USS MB each worker (median run) | PSS MB |"
          "\n|---|---|---|---|---|")
    for workers in args.workers:
        for persistent in ("fresh", "persistent"):
            for kind in LOADERS:
                runs = figures[f"{kind}:{workers}:{persistent}"]
                uss = statistics.median(statistics.median(run["uss_mb"]) for run in runs)
                pss = statistics.median(statistics.median(run["pss_mb"]) for run in runs)
                print(f"| {workers} | {'yes' if persistent == 'persistent' else 'no'} | "
                      f"{kind} | {uss:,.0f} | {pss:,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=IMAGENET_TRAIN)
    parser.add_argument("--workers", default="2,8", help="worker counts, comma-separated")
    parser.add_argument("--context", default="forkserver", help="the start method")
    parser.add_argument("--preload", choices=("script", "none"), default="script",
                        help="what a forkserver imports before it forks: the script's modules, "
                             "as Python 3.14's does (default), or nothing, as 3.11 to 3.13.0 do")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one configuration
    args = parser.parse_args()
    if args.one:
        print(json.dumps(child(args.one, args)))
        return
    args.workers = [int(w) for w in args.workers.split(",")]
    args.load_before = os.getloadavg()
    common = ["--samples", str(args.samples), "--context", args.context,
              "--epochs", str(args.epochs), "--preload", args.preload]
    configs = [f"{k}:{w}:{p}" for w in args.workers for p in ("fresh", "persistent")
               for k in LOADERS] + [f"floor:{w}:-" for w in args.workers]
    figures = interleaved_rates(__file__, configs, args.rounds, common, desc="epoch starts")
    report(figures, args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    multiprocessing.freeze_support()
    main()
