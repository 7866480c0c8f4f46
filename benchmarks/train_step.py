"""A real training step fed three ways: how much of the step time does data loading cost?

Cases, interleaved over ``--repeats`` and reported as medians:

- ``synthetic``: one batch already on the device, reused: the upper bound.
- ``stock``: torch's DataLoader with ``pin_memory=True``; the loop calls
  ``.to(device, non_blocking=True)`` and normalises on the device.
- ``fastfeed``: ``FastLoader(device=..., gpu_transform=Normalize + ChannelsLast)``.

Each reports images/s and the data stall: the share of wall time the loop spent waiting for
its next batch (in ``next()`` and the host-to-device call).

On a GPU (defaults): torchvision ResNet-50 at batch 256, 224 px, AMP (bf16) and
channels_last; ``--model yolo-like`` runs a small conv net at 640 px. On a CPU it runs a tiny
model on small images, so that the script itself is tested:

    python benchmarks/train_step.py                          # on a GPU machine
    python benchmarks/train_step.py --device cpu --steps 4   # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastfeed import FastLoader
from fastfeed import transforms as T
from fastfeed.bench.data import SyntheticImages
from fastfeed.bench.models import build_model
from fastfeed.progress import progress


def run_case(case: str, args: argparse.Namespace, device: torch.device) -> dict:
    model = build_model(args.model, args.classes).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    normalize = T.Compose([T.Normalize(key=0), T.ChannelsLast(key=0)])
    amp = device.type == "cuda"
    dataset = SyntheticImages(args.size, args.classes, length=1_000_000)

    if case == "synthetic":
        images, labels = next(iter(DataLoader(dataset, batch_size=args.batch_size)))
        fixed = normalize((images.to(device), labels.to(device)))
        batches = iter(lambda: fixed, None)
    elif case == "stock":
        loader = DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers,
                            pin_memory=device.type == "cuda", shuffle=True)

        def stock_batches():
            for images, labels in loader:
                yield normalize((images.to(device, non_blocking=True),
                                 labels.to(device, non_blocking=True)))

        batches = stock_batches()
    else:
        batches = iter(FastLoader(dataset, batch_size=args.batch_size, num_workers=args.workers,
                                  device=device, gpu_transform=normalize, shuffle=True))

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        step(*next(batches))
    sync()
    waited = 0.0
    start = time.perf_counter()
    for _ in range(args.steps):
        before = time.perf_counter()
        images, labels = next(batches)
        waited += time.perf_counter() - before
        step(images, labels)
    sync()
    elapsed = time.perf_counter() - start
    return {"images_per_s": args.steps * args.batch_size / elapsed,
            "step_ms": 1000 * elapsed / args.steps, "stall_pct": 100 * waited / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=["resnet50", "yolo-like", "tiny"])
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--size", type=int, help="image side in pixels")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    # FastLoader sends its first prefetch_factor × workers batches before the slot pool knows the
    # batch size; warm up past them so that steady state is measured.
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--cases", nargs="+", default=["synthetic", "stock", "fastfeed"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    if args.model is None:
        args.model = "resnet50" if on_gpu else "tiny"
    defaults = {"resnet50": (256, 224), "yolo-like": (64, 640), "tiny": (16, 64)}[args.model]
    args.batch_size = args.batch_size or defaults[0]
    args.size = args.size or defaults[1]
    if not on_gpu:
        args.workers = min(args.workers, 2)

    runs: dict[str, list[dict]] = {case: [] for case in args.cases}
    order = [(r, case) for r in range(args.repeats)
             for case in (args.cases if r % 2 == 0 else args.cases[::-1])]
    for _, case in progress(order, total=len(order), desc="runs"):
        runs[case].append(run_case(case, args, device))

    name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"\n{args.model}, batch {args.batch_size}, {args.size} px, {args.workers} workers, "
          f"{name}; medians of {args.repeats} runs of {args.steps} steps\n")
    print("| case | images/s | step ms | data stall % | vs synthetic |")
    print("|---|---|---|---|---|")
    summary = {case: {key: statistics.median(r[key] for r in results) for key in results[0]}
               for case, results in runs.items()}
    bound = summary.get("synthetic", {}).get("step_ms")
    for case, figures in summary.items():
        gap = f"{100 * (figures['step_ms'] / bound - 1):+.1f} %" if bound else "n/a"
        print(f"| {case} | {figures['images_per_s']:.0f} | {figures['step_ms']:.1f} "
              f"| {figures['stall_pct']:.1f} | {gap} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "device": name, "summary": summary, "runs": runs},
                                        indent=2))


if __name__ == "__main__":
    main()
