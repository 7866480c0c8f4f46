"""A torchvision training loop fed each way fastfeed offers: how much of the GPU does it keep busy?

ResNet-50 (torchvision), bf16 autocast, channels_last, SGD, batch 256, ``loss.item()`` every
step (as a logging loop does), on ``--images`` generated ImageNet-like JPEGs (about 500×375,
q90, in a temporary folder); torchvision's ``ImageFolder`` with the classic transforms
(RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize); ``--workers`` workers,
persistent, shuffled, whole batches. Feeds:

- ``gpu-alone``: one batch already on the device, reused: the GPU's own rate.
- ``stock``: torch's ``DataLoader(pin_memory=True)``; the loop copies ``non_blocking``.
- ``swap``: ``FastLoader`` with the same arguments (the import swap).
- ``accelerate``: ``FastLoader`` over ``fastfeed.vision.accelerate(dataset)``, pinned.
- ``accelerate-device``: the same with ``device="cuda"`` (the tail on the copy stream).
- ``nvjpeg``: ``image_loader(root, backend="nvjpeg", device="cuda")`` normalised on the GPU
  (fastfeed's own ImageFolder, not the user's dataset).
- ``gpu-decode``: ``accelerate(dataset, decode_device="cuda")`` + ``FastLoader(device="cuda")``.

Each (feed, repeat) runs in a fresh process, feeds alternating order from repeat to repeat:
``--warmup`` steps, then ``--steps`` timed ones. Per feed, the medians over repeats of:
images/s, the share of the time spent waiting for data (in ``next()`` and the copy call),
and how busy NVML saw the GPU during the timed steps. ``--json`` is rewritten after every run,
so a run cut short keeps the feeds that ran; a feed whose run fails gets its error as its row,
the others still run (the exit status is then 1). On a CPU the cuda-only feeds are left out
with a note; ``--model tiny`` makes it a smoke run:

    python3 benchmarks/torchvision_train.py --device cuda --workers 8 --images 2048 \\
        --feeds gpu-alone,stock,swap,accelerate,accelerate-device,nvjpeg,gpu-decode \\
        --warmup 8 --steps 30 --json OUT.json
    python3 benchmarks/torchvision_train.py --device cpu --model tiny --images 64 --steps 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.interleaved import interleaved_runs
from fastfeed.bench.data import classic_imagefolder
from fastfeed.bench.models import build_model

FEEDS = ("gpu-alone", "stock", "swap", "accelerate", "accelerate-device", "nvjpeg",
         "gpu-decode")
CUDA_ONLY = ("nvjpeg", "gpu-decode")


def batches(feed: str, args: argparse.Namespace, device: torch.device) -> Iterator[Any]:
    """The feed's batches, endlessly (epoch after epoch)."""
    from torch.utils.data import DataLoader

    from fastfeed import FastLoader
    from fastfeed import transforms as T
    from fastfeed.vision import accelerate, image_loader

    kwargs: dict[str, Any] = {"batch_size": args.batch_size, "shuffle": True, "drop_last": True,
                              "num_workers": args.workers, "persistent_workers": True}
    pinned = {"pin_memory": device.type == "cuda"}
    if feed in ("stock", "gpu-alone"):
        loader: Any = DataLoader(classic_imagefolder(args.data), **kwargs, **pinned)
    elif feed == "swap":
        loader = FastLoader(classic_imagefolder(args.data), **kwargs, **pinned)
    elif feed == "accelerate":
        loader = FastLoader(classic_imagefolder(args.data, accelerated=True), **kwargs, **pinned)
    elif feed == "accelerate-device":
        loader = FastLoader(classic_imagefolder(args.data, accelerated=True), device=device,
                            **kwargs)
    elif feed == "nvjpeg":
        loader = image_loader(args.data, backend="nvjpeg", device=device,
                              gpu_transform=T.Normalize(key=0), **kwargs)
    else:
        loader = FastLoader(accelerate(classic_imagefolder(args.data), decode_device="cuda"),
                            device=device, **kwargs)
    if feed == "gpu-alone":
        fixed = [t.to(device) for t in next(iter(loader))]
        del loader
        return itertools.repeat(fixed)
    return itertools.chain.from_iterable(itertools.repeat(loader))


def run_feed(feed: str, args: argparse.Namespace) -> dict[str, float | None]:
    from fastfeed.gpu_sampler import GpuSampler

    device = torch.device(args.device)
    model = build_model(args.model, args.classes).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    feed_batches = batches(feed, args, device)

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = nn.functional.cross_entropy(model(images), labels % args.classes)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss.item()  # a logging loop's read: the host waits for the step

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = next(feed_batches)
        images = images.to(device, non_blocking=True).contiguous(
            memory_format=torch.channels_last)
        return images, labels.to(device, non_blocking=True)

    for _ in range(args.warmup):
        step(*next_batch())
    sampler = GpuSampler(device.index or 0, interval=0.1) if device.type == "cuda" else None
    if sampler is not None:
        sampler.start()
    waited, start = 0.0, time.perf_counter()
    for _ in range(args.steps):
        before = time.perf_counter()
        images, labels = next_batch()
        waited += time.perf_counter() - before
        step(images, labels)
    elapsed = time.perf_counter() - start
    busy = None
    if sampler is not None:
        sampler.stop()
        readings = sampler.since_start()
        busy = readings[0].utilization if readings else None
    return {"images_per_s": args.steps * args.batch_size / elapsed,
            "wait_share": waited / elapsed, "gpu_busy": busy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=["resnet50", "tiny"])
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--feeds", default=",".join(FEEDS))
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)  # a child's image folder
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one feed
    args = parser.parse_args()
    on_gpu = torch.device(args.device).type == "cuda"
    args.model = args.model or ("resnet50" if on_gpu else "tiny")
    args.batch_size = args.batch_size or (256 if args.model == "resnet50" else 8)
    if args.one:
        print(json.dumps([run_feed(args.one, args)]))
        return

    feeds = [f for f in args.feeds.split(",") if on_gpu or f not in CUDA_ONLY]
    for left_out in sorted(set(args.feeds.split(",")) - set(feeds)):
        print(f"{left_out}: needs CUDA, left out")
    name = torch.cuda.get_device_name(args.device) if on_gpu else "CPU"
    runs: dict[str, list[dict[str, Any]]] = {feed: [] for feed in feeds}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="fastfeed-train-") as folder:
        from fastfeed.vision.synthetic import make_imagefolder

        make_imagefolder(Path(folder), args.images, classes=100)
        child = [a for a in sys.argv[1:] if a not in ("--json", str(args.json))]
        for feed, result in interleaved_runs(__file__, feeds, args.repeats,
                                             [*child, "--data", folder], desc="feeds"):
            if isinstance(result, str):
                errors[feed] = result.splitlines()[-1]
                print(f"{feed} failed:\n{result}", file=sys.stderr)
            else:
                runs[feed] += result
            rows = table(runs, errors)
            if args.json:
                args.json.write_text(json.dumps({"device": name, "args": vars(args) | {
                    "json": str(args.json), "data": None}, "rows": rows}, indent=2))
    print(f"\n{args.model}, batch {args.batch_size}, {args.workers} workers, {args.images} "
          f"JPEGs, {name}; medians of {args.repeats} runs of {args.steps} steps\n")
    print("| feed | images/s | vs stock | waiting | GPU busy |\n|---|---|---|---|---|")
    for row in table(runs, errors):
        if "error" in row:
            print(f"| {row['feed']} | failed: {row['error']} | | | |")
            continue
        vs = f"{row['vs_stock']:.2f}×" if row["vs_stock"] else "n/a"
        busy = f"{row['gpu_busy']:.0f} %" if row["gpu_busy"] is not None else "n/a"
        print(f"| {row['feed']} | {row['images_per_s']:,.0f} | {vs} | "
              f"{100 * row['wait_share']:.0f} % | {busy} |")
    sys.exit(f"failed: {', '.join(errors)}" if errors else 0)


def table(runs: dict[str, list[dict[str, Any]]], errors: dict[str, str]
          ) -> list[dict[str, Any]]:
    """A row per feed that ran or failed so far: the medians of its runs, or its error."""
    rows: list[dict[str, Any]] = []
    for feed, results in runs.items():
        if feed in errors:
            rows.append({"feed": feed, "error": errors[feed]})
        elif results:
            row: dict[str, Any] = {"feed": feed}
            for key in ("images_per_s", "wait_share", "gpu_busy"):
                values = [r[key] for r in results if r[key] is not None]
                row[key] = statistics.median(values) if values else None
            rows.append(row)
    stock = next((r["images_per_s"] for r in rows if r["feed"] == "stock" and "error" not in r),
                 None)
    for row in rows:
        if "error" not in row:
            row["vs_stock"] = row["images_per_s"] / stock if stock else None
    return rows

if __name__ == "__main__":
    main()
