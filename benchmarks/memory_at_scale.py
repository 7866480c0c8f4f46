"""Worker memory, start-up and file descriptors at ImageNet scale, stock and fastfeed side by side.

The dataset holds 1,281,167 ``(path, class)`` pairs as torchvision's ``ImageFolder`` holds them
(``samples``, the same list as ``imgs``, and ``targets``); an item reads its pair and returns
``(len(path), class)``, so that nothing but the lists is measured. Batch 1024, shuffled,
persistent workers, the plain import swap (fastfeed's defaults). Measured:

- **memory**: each worker's private memory (USS: ``Private_Clean + Private_Dirty`` of
  ``/proc/PID/smaps_rollup``) once the first batch has arrived and every worker has started,
  and what it gains by the end of one epoch (a forked stock worker copies every page of the
  lists it reads: "copy-on-read");
- **start-up**: seconds from ``iter(loader)`` to the first batch, workers started and the lists
  pickled to them (stock, spawn) or packed (fastfeed); medians of ``--rounds`` fresh loaders.
  Beside them, the floor: as many bare processes started the same way, each importing what a
  worker imports (this script, torch, fastfeed) and reporting back;
- **packing**: what packing the lists costs fastfeed's main process, median of ``--rounds``;
- **descriptors**: ``--fd-loaders`` two-worker persistent loaders over a dataset of 20,000
  pairs, each iterated once: descriptors open in the main process, and in all workers together.

Every configuration runs in a fresh process, stock and fastfeed alternating.

    python benchmarks/memory_at_scale.py                    # the full scale: about 15 minutes
    python benchmarks/memory_at_scale.py --samples 20000 --workers 2 --rounds 1   # a quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.interleaved import interleaved_rates
from fastfeed import FastLoader
from fastfeed.shared_lists import ListsSnapshot

IMAGENET_TRAIN = 1_281_167
LOADERS = {"stock": DataLoader, "fastfeed": FastLoader}


class FolderIndex(Dataset):
    """An ``ImageFolder``'s bookkeeping without its images: ``n`` ``(path, class)`` pairs."""

    def __init__(self, n: int, classes: int = 1000) -> None:
        self.samples = [(f"/data/imagenet/train/n{c:08d}/n{c:08d}_{i}.JPEG", c)
                        for i, c in ((i, i % classes) for i in range(n))]
        self.imgs = self.samples
        self.targets = [c for _, c in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[int, int]:
        path, target = self.samples[index]
        return len(path), target


def private_mb(pid: int) -> float:
    """The process's private memory (USS) in MB."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return sum(int(fields[k].split()[0]) for k in ("Private_Clean", "Private_Dirty")) / 1024


def worker_pids() -> list[int]:
    """This process's DataLoader workers (both loaders name them ``pt_data_worker``)."""
    pids = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    named = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "pt_data_worker":
                    named.append(pid)
        except OSError:
            continue
    return sorted(named)


def open_fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def loader_of(kind: str, dataset: Dataset, context: str, workers: int,
              persistent: bool = True) -> DataLoader:
    return LOADERS[kind](dataset, batch_size=1024, shuffle=True, num_workers=workers,
                         persistent_workers=persistent, multiprocessing_context=context)


def run_epoch(kind: str, context: str, workers: int, samples: int) -> dict[str, Any]:
    """One epoch: time to the first batch, each worker's USS then and its gain by the end."""
    dataset = FolderIndex(samples)
    gc.collect()
    loader = loader_of(kind, dataset, context, workers)
    started = time.perf_counter()
    iterator = iter(loader)
    next(iterator)
    first_batch_s = time.perf_counter() - started
    pids = worker_pids()
    while len(pids) < workers:  # spawned workers may still be starting: wait for them all
        time.sleep(0.1)
        pids = worker_pids()
    at_first = [private_mb(pid) for pid in pids]
    for _ in iterator:
        pass
    epoch_s = time.perf_counter() - started
    at_end = [private_mb(pid) for pid in pids]  # persistent: still alive
    return {"first_batch_s": first_batch_s, "epoch_s": epoch_s, "uss_first_mb": at_first,
            "gained_mb": [end - first for first, end in zip(at_first, at_end, strict=True)]}


def run_start(kind: str, context: str, workers: int, samples: int) -> float:
    """Seconds to the first batch of a new (non-persistent) loader."""
    loader = loader_of(kind, FolderIndex(samples), context, workers, persistent=False)
    started = time.perf_counter()
    iterator = iter(loader)
    next(iterator)
    elapsed = time.perf_counter() - started
    del iterator
    return elapsed


def _report_ready(queue: Any) -> None:
    queue.put(os.getpid())


def run_floor(context: str, workers: int) -> float:
    """Seconds until ``workers`` bare processes of ``context`` have started and reported."""
    ctx = multiprocessing.get_context(context)
    queue = ctx.SimpleQueue()
    started = time.perf_counter()
    processes = [ctx.Process(target=_report_ready, args=(queue,)) for _ in range(workers)]
    for process in processes:
        process.start()
    for _ in processes:
        queue.get()
    elapsed = time.perf_counter() - started
    for process in processes:
        process.join()
    return elapsed


def run_packing(samples: int, rounds: int) -> dict[str, Any]:
    """What packing the lists costs the main process, once per worker start."""
    dataset = FolderIndex(samples)
    times, nbytes = [], 0
    for _ in range(rounds):
        started = time.perf_counter()
        snapshot = ListsSnapshot.take(dataset, keep_fd=False)
        times.append(time.perf_counter() - started)
        assert snapshot.packed is not None
        nbytes = snapshot.packed.nbytes
        del snapshot
    return {"seconds": times, "packed_mb": nbytes / 1e6}


def run_fds(kind: str, loaders: int) -> dict[str, int]:
    """Descriptors held with ``loaders`` two-worker persistent loaders, each iterated once."""
    base = open_fds()
    kept = []
    for _ in range(loaders):
        loader = LOADERS[kind](FolderIndex(20_000), batch_size=1024, num_workers=2,
                               persistent_workers=True)
        for _ in loader:
            pass
        kept.append(loader)
    pids = worker_pids()
    return {"main": open_fds() - base, "workers": sum(open_fds(pid) for pid in pids),
            "worker_count": len(pids)}


def child(config: str, args: argparse.Namespace) -> Any:
    what, *rest = config.split(":")
    if what == "epoch":
        kind, context, workers = rest
        return [run_epoch(kind, context, int(workers), args.samples)]
    if what == "start":
        kind, context, workers = rest
        if kind == "floor":
            return [run_floor(context, int(workers))]
        return [run_start(kind, context, int(workers), args.samples)]
    if what == "pack":
        return [run_packing(args.samples, args.rounds)]
    kind = rest[0]
    return [run_fds(kind, args.fd_loaders)]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    common = ["--samples", str(args.samples), "--rounds", str(args.rounds),
              "--fd-loaders", str(args.fd_loaders)]
    cases = [(c, w) for c in args.contexts for w in args.workers]
    figures: dict[str, Any] = {}
    figures["epoch"] = interleaved_rates(
        __file__, [f"epoch:{k}:{c}:{w}" for c, w in cases for k in LOADERS], 1, common,
        desc="one epoch each")
    figures["start"] = interleaved_rates(
        __file__, [f"start:{k}:{c}:{w}" for c, w in cases for k in (*LOADERS, "floor")],
        args.rounds, common, desc="start-up")
    figures["pack"] = interleaved_rates(__file__, ["pack"], 1, common, desc="packing")
    figures["fds"] = interleaved_rates(__file__, [f"fds:{k}" for k in LOADERS], 1, common,
                                       desc="descriptors")
    return figures


def report(figures: dict[str, Any], args: argparse.Namespace) -> None:
    def mb(values: list[float]) -> str:
        return ", ".join(f"{v:,.0f}" for v in values)

    print(f"{args.samples:,} (path, class) pairs, batch 1024, shuffled, persistent workers; "
          f"torch {torch.__version__}, {os.cpu_count()} cores, load average before "
          f"{args.load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    print("\n| start | workers | loader | private MB each worker gains over the epoch | "
          "private MB at the first batch | first batch s | epoch s |\n"
          "|---|---|---|---|---|---|---|")
    for config, (record,) in figures["epoch"].items():
        _, kind, context, workers = config.split(":")
        print(f"| {context} | {workers} | {kind} | {mb(record['gained_mb'])} | "
              f"{mb(record['uss_first_mb'])} | {record['first_batch_s']:.2f} | "
              f"{record['epoch_s']:.1f} |")
    def seconds(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"

    print(f"\nfirst batch, medians of {args.rounds} fresh loaders (min–max)")
    print("| start | workers | stock s | fastfeed s | fastfeed / stock | bare processes s |\n"
          "|---|---|---|---|---|---|")
    for context in args.contexts:
        for workers in args.workers:
            stock, fast, floor = (figures["start"][f"start:{k}:{context}:{workers}"]
                                  for k in (*LOADERS, "floor"))
            print(f"| {context} | {workers} | {seconds(stock)} | {seconds(fast)} | "
                  f"**{statistics.median(fast) / statistics.median(stock):.2f}×** | "
                  f"{seconds(floor)} |")
    (pack,) = figures["pack"]["pack"]
    print(f"\npacking the lists in the main process: {seconds(pack['seconds'])} s, "
          f"{args.rounds} rounds; {pack['packed_mb']:.0f} MB shared")
    print(f"\n| {args.fd_loaders} two-worker persistent loaders | main process | all workers |"
          "\n|---|---|---|")
    for kind in LOADERS:
        (fds,) = figures["fds"][f"fds:{kind}"]
        print(f"| {kind} | {fds['main']:,} | {fds['workers']:,} ({fds['worker_count']} "
              "workers) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=IMAGENET_TRAIN)
    parser.add_argument("--workers", default="2,8", help="worker counts, comma-separated")
    parser.add_argument("--contexts", default="fork,spawn", help="start methods")
    parser.add_argument("--rounds", type=int, default=5, help="start-up and packing repeats")
    parser.add_argument("--fd-loaders", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one configuration
    args = parser.parse_args()
    if args.one:
        print(json.dumps(child(args.one, args)))
        return
    args.workers = [int(w) for w in args.workers.split(",")]
    args.contexts = args.contexts.split(",")
    args.load_before = os.getloadavg()
    figures = measure(args)
    report(figures, args)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
