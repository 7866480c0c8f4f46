"""What ``next()`` costs on a ready batch with ``pin_memory=True`` and no ``device=``: fastfeed
against the stock DataLoader (issue 41).

Both loaders copy each batch into pinned memory: the stock loader on its pin thread, fastfeed on
a helper thread, ahead of the consumer (before issue 41, fastfeed copied in ``next()``, on the
training thread). ``pin_memory()`` needs CUDA, so on a machine without it both get the same
stand-in, a real copy of every tensor into fresh memory (the stock loader through torch's
``pin_memory`` in its pin thread, fastfeed through ``fastfeed.device.pinned.pin_batch``; an
older tree through the function its iterators called). The consumer is slower than the loader
(a training step of ``--step-ms``), so every batch is ready when ``next()`` is called: the time
inside ``next()`` is then the loader's own work on the training thread. Each run is a fresh
process; the loaders alternate, the order reversed every other round.

    python benchmarks/pin_ahead.py --rounds 8
    python benchmarks/pin_ahead.py --rounds 8 --before /tmp/before   # and an older tree
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[1]


class Images(Dataset):
    """Fixed-size uint8 images (a YOLO batch at imgsz 640 with ``batch_size=16``); each
    sample is a fresh tensor, as a decoding pipeline's would be."""

    def __init__(self, n: int, shape: tuple[int, ...]) -> None:
        self.n = n
        self.image = torch.randint(0, 255, shape, dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.image.clone(), i


class StandIn:
    """The pinned copy on a machine without CUDA: a copy of every tensor into fresh memory;
    counts the copies made on the training thread."""

    def __init__(self) -> None:
        self.on_training_thread = 0
        self.copies = 0

    def __call__(self, batch: Any, device: Any = None) -> Any:
        self.copies += 1
        self.on_training_thread += threading.current_thread() is threading.main_thread()
        return self._copy(batch)

    def _copy(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return torch.empty_like(batch).copy_(batch)
        if isinstance(batch, (list, tuple)):
            return type(batch)(self._copy(item) for item in batch)
        return batch


def _ready(iterator: Any) -> bool | None:
    """Whether a pinned batch waits for ``next()`` (None where that cannot be seen)."""
    helper = getattr(iterator, "helper", None)
    if helper is not None:  # fastfeed's pinned iterator
        return bool(helper.queue.items)
    data_queue = getattr(iterator, "_data_queue", None)  # the stock loader's pin thread output
    return bool(data_queue.qsize()) if hasattr(data_queue, "qsize") else None


def _patch_stock(stand_in: StandIn) -> None:
    """torch's pin thread, as on a machine with an accelerator, with the stand-in's copy."""
    import torch.utils.data._utils.pin_memory as torch_pinning

    torch.accelerator.is_available = lambda: True  # type: ignore[assignment]
    torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment]
    torch.accelerator.set_device_index = lambda index: None  # type: ignore[assignment]
    torch_pinning.pin_memory = stand_in  # type: ignore[assignment]


def _patch_fastfeed(stand_in: StandIn) -> None:
    """fastfeed's pinning, as on a machine with CUDA, with the stand-in's copy."""
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    try:
        import fastfeed.device.pinned as pinned

        pinned.pin_batch = stand_in  # type: ignore[assignment]
    except ImportError:  # a tree from before issue 41: the iterators pinned in next()
        import fastfeed.iterators.base_iterator as base

        base.pin_memory = stand_in  # type: ignore[attr-defined]


def child(name: str, args: argparse.Namespace) -> dict[str, float]:
    """One run: the median time inside ``next()`` on ready batches, in microseconds."""
    stand_in = StandIn()
    if name == "stock":
        _patch_stock(stand_in)
        cls: type[DataLoader] = DataLoader
    else:
        sys.path.insert(0, str(Path(args.tree).resolve()))
        _patch_fastfeed(stand_in)
        from fastfeed import FastLoader

        cls = FastLoader
    torch.set_num_threads(1)
    dataset = Images(args.batch_size * (args.batches + args.warmup), (3, 640, 640))
    loader = cls(dataset, batch_size=args.batch_size, num_workers=args.workers,
                 pin_memory=True)
    step = args.step_ms / 1000
    times, ready = [], []
    iterator = iter(loader)
    for i in range(args.batches + args.warmup):
        time.sleep(step)  # the training step: the loader is ahead
        waiting = _ready(iterator)
        start = time.perf_counter()
        batch = next(iterator)
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            times.append(elapsed)
            ready.append(waiting)
        del batch
    del iterator
    seen = [r for r in ready if r is not None]
    return {"next_us": 1e6 * statistics.median(times),
            "next_p90_us": 1e6 * statistics.quantiles(times, n=10)[-1],
            "ready_pct": 100 * sum(seen) / len(seen) if seen else -1.0,
            "copies_on_training_thread": stand_in.on_training_thread,
            "copies": stand_in.copies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=150.0)
    parser.add_argument("--tree", default=str(ROOT), help="the fastfeed tree under test")
    parser.add_argument("--before", help="an older fastfeed tree, measured alongside")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    loaders = {"stock": str(ROOT), "fastfeed": args.tree}
    if args.before:
        loaders["before"] = args.before
    names = list(loaders)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    common = ["--batches", str(args.batches), "--warmup", str(args.warmup), "--batch-size",
              str(args.batch_size), "--workers", str(args.workers), "--step-ms",
              str(args.step_ms)]
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out = subprocess.run(
                [sys.executable, __file__, "--child", "fastfeed" if name != "stock" else name,
                 "--tree", loaders[name], *common],
                capture_output=True, text=True, check=False, cwd=loaders[name])
            if out.returncode:
                sys.exit(f"{name}: {out.stderr[-3000:]}")
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{args.rounds} {name}: {runs[name][-1]}", file=sys.stderr)
    stock = statistics.median(run["next_us"] for run in runs["stock"])
    print(f"next() on a ready batch, {args.batch_size} x 3 x 640 x 640 uint8, {args.workers} "
          f"workers, a {args.step_ms:g} ms step; medians of {args.rounds} runs "
          f"({args.batches} batches each)")
    print("| loader | next() µs, median (runs' range) | p90 µs | / stock | batch ready | "
          "copies in next() |")
    print("|---|---|---|---|---|---|")
    for name in names:
        medians = [run["next_us"] for run in runs[name]]
        median = statistics.median(medians)
        p90 = statistics.median(run["next_p90_us"] for run in runs[name])
        in_next = sum(run["copies_on_training_thread"] for run in runs[name])
        copies = sum(run["copies"] for run in runs[name])
        ready = statistics.median(run["ready_pct"] for run in runs[name])
        print(f"| {name} | {median:,.0f} ({min(medians):,.0f}–{max(medians):,.0f}) | "
              f"{p90:,.0f} | {median / stock:.2f}× | "
              f"{'n/a' if ready < 0 else f'{ready:.0f} %'} | {in_next} of {copies} |")


if __name__ == "__main__":
    main()
