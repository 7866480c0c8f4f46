"""How long does a training loop whose step takes a fixed time wait for Ultralytics' batches?

A model of the trainer, not the trainer: Ultralytics' own ``YOLODataset`` (mosaic, warp, HSV,
flips) and ``build_dataloader`` (its ``InfiniteDataLoader``, ``prefetch_factor=4``, seeded
generator), iterated epoch after epoch as ``model.train()`` does, by a loop whose step takes
``--step-ms`` instead of a forward and backward pass. Where the loader keeps up, the loop
should wait for nothing; a loader that keeps up on average but not at every batch (an epoch
boundary, a burst of slow samples, work on the consumer's thread) shows as waiting.

Steps (``--consumer``):

- ``sleep``: the thread sleeps, as a trainer waiting on its GPU does (``loss.item()``): it
  holds neither a core nor the GIL.
- ``spin``: the thread runs Python for the whole step, as a trainer launching many small
  kernels does: it holds the GIL but at switch intervals, and a core.

``--pin-ms`` models ``pin_memory=True`` on a CUDA machine (what Ultralytics passes there) on
this CPU-only one: both loaders pin (torch's pin thread, FastLoader wherever it pins), and the
pinned copy is a real copy of the batch plus ``--pin-ms`` of waiting, as page-locked allocation
and first-touch faults cost on a GPU machine.

Configurations: ``stock`` (Ultralytics' loader) and ``patched`` (``fastfeed.ultralytics.patch()``),
each in a fresh process, interleaved over ``--repeats``. Per configuration: the median share of
each timed epoch's wall time spent waiting for a batch, the worst single wait, and where
FastLoader's ``stats()`` say its time went.

    python benchmarks/fixed_step.py --batches 16 --step-ms 56 --batch-size 4
    python benchmarks/fixed_step.py --batches 200 --step-ms 56 --batch-size 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.interleaved import interleaved_rates, pipeline_parser

CONFIGS = ("stock", "patched")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def model_pinning(pin_ms: float) -> None:
    """Make both loaders pin on this CPU-only machine, with a pinned copy that takes
    ``pin_ms`` more than the copy itself (see the module's notes)."""
    import torch
    from torch.utils.data._utils import pin_memory as torch_pinning

    def copy(data: Any) -> Any:
        if isinstance(data, torch.Tensor):
            return data.clone()
        if isinstance(data, dict):
            return {key: copy(value) for key, value in data.items()}
        if isinstance(data, (list, tuple)):
            return type(data)(copy(value) for value in data)
        return data

    def pin(data: Any, device: Any = None) -> Any:
        time.sleep(pin_ms / 1e3)
        return copy(data)

    torch_pinning.pin_memory = pin  # torch's pin thread and fastfeed both call it from here
    torch.accelerator.is_available = lambda: True  # torch's iterator pins only then
    torch.accelerator.current_accelerator = lambda check_available=False: None
    torch.accelerator.current_device_index = lambda: 0
    torch.accelerator.set_device_index = lambda device: None
    torch.cuda.is_available = lambda: True  # fastfeed pins only then


def run_epochs(config: str, root: Path, args: Any) -> list[dict[str, Any]]:
    """Every timed epoch of ``config``, in this process."""
    os.environ["YOLO_OFFLINE"] = "1"
    import torch
    from ultralytics.cfg import get_cfg
    from ultralytics.data import build_dataloader, build_yolo_dataset
    from ultralytics.utils import DEFAULT_CFG

    import fastfeed.ultralytics

    if config == "patched":
        fastfeed.ultralytics.patch()
    torch.manual_seed(0)
    cfg = get_cfg(DEFAULT_CFG, {"imgsz": args.imgsz})
    data = {"names": {i: str(i) for i in range(8)}, "nc": 8, "channels": 3}
    dataset = build_yolo_dataset(cfg, str(root / "images"), args.batch_size, data, mode="train")
    loader = build_dataloader(dataset, args.batch_size, args.workers, shuffle=True, rank=-1)
    if args.pin_ms:
        model_pinning(args.pin_ms)
        loader.pin_memory = True  # build_dataloader pins only where it counts a GPU
    step = args.step_ms / 1e3
    work = time.sleep if args.consumer == "sleep" else _spin
    epochs = []
    for epoch in range(args.epochs + 1):  # the first warms up: workers start, buffers fill
        if hasattr(loader, "stats"):
            loader.stats(reset=True)
        waits: list[float] = []
        start = asked = time.perf_counter()
        for _ in loader:
            waits.append(time.perf_counter() - asked)
            work(step)
            asked = time.perf_counter()
        elapsed = time.perf_counter() - start
        if not epoch:
            continue
        record: dict[str, Any] = {"images_per_s": len(waits) * args.batch_size / elapsed,
                                  "wait_share": sum(waits) / elapsed,
                                  "worst_wait_ms": 1e3 * max(waits),
                                  "first_wait_ms": 1e3 * waits[0], "batches": len(waits)}
        if hasattr(loader, "stats"):
            stats = loader.stats()
            record.update(stage_ms=stats.stage_ms, workers_busy=stats.worker_utilization)
        epochs.append(record)
    loader.close()
    return epochs


def main() -> None:
    parser = pipeline_parser(__doc__, CONFIGS, batch_size=4)
    parser.add_argument("--batches", type=int, default=16, help="batches per epoch")
    parser.add_argument("--step-ms", type=float, default=56.0)
    parser.add_argument("--consumer", choices=["sleep", "spin"], default="sleep")
    parser.add_argument("--pin-ms", type=float, default=0.0,
                        help="model pin_memory=True: each pinned copy takes this much longer")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--widths", default="1280,1920")
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_epochs(args.one, args.data, args)))
        return

    from benchmarks.ultralytics_pipeline import make_photo_yolo
    from fastfeed.bench.data import CACHE

    lo, hi = (int(w) for w in args.widths.split(","))
    images = args.batches * args.batch_size
    root = CACHE / f"yolo-photos-{images}-{lo}-{hi}"
    if not root.exists():
        make_photo_yolo(root, images, (lo, hi))
    results = interleaved_rates(
        __file__, args.configs.split(","), args.repeats,
        ["--data", str(root), "--imgsz", str(args.imgsz), "--workers", str(args.workers),
         "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
         "--step-ms", str(args.step_ms), "--consumer", args.consumer,
         "--pin-ms", str(args.pin_ms)],
        desc="fixed-step training")
    pinning = f", pinned copies +{args.pin_ms:g} ms" if args.pin_ms else ""
    print(f"\nA {args.step_ms:g} ms {args.consumer} step on Ultralytics' loader: {root.name}, "
          f"imgsz {args.imgsz}, batch {args.batch_size}, {args.batches} batches an epoch, "
          f"{args.workers} workers{pinning}; medians of {args.repeats} runs × {args.epochs} "
          f"timed epochs; load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| loader | waiting | worst wait | first wait | FastLoader's ms per batch, workers "
          "busy |\n|---|---|---|---|---|")
    for config, epochs in results.items():
        line = (f"| {config} | {100 * statistics.median(e['wait_share'] for e in epochs):.1f} % "
                f"| {statistics.median(e['worst_wait_ms'] for e in epochs):.0f} ms "
                f"| {statistics.median(e['first_wait_ms'] for e in epochs):.0f} ms | ")
        if "stage_ms" in epochs[0]:
            stages = ", ".join(f"{s} {statistics.median(e['stage_ms'][s] for e in epochs):.1f}"
                               for s in epochs[0]["stage_ms"])
            busy = statistics.median(e["workers_busy"] for e in epochs)
            line += f"{stages}; {busy:.0%} busy"
        print(line + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json),
                                                               "data": str(root)},
                                         "runs": results}, indent=2))


if __name__ == "__main__":
    main()
