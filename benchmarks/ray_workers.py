"""Ray workers against worker processes on one machine: same cores, same run, interleaved.

``worker_mode="ray"`` puts the workers on a cluster; here the "cluster" is this machine
(``ray.init(num_cpus=--workers)``: as many CPUs as workers, one per actor), so the figures are
the price of Ray itself next to process workers on the same cores. Each case runs with
``worker_mode="process"`` and ``worker_mode="ray"``:

- ``u8``: the torchvision pipeline (``ImageFolder``, RandomResizedCrop 224, flip, ToTensor,
  Normalize) under ``fastfeed.vision.accelerate`` with ``device="cpu"``: workers make uint8
  crops, and the batch tail (ToTensor's scaling, Normalize) runs on whole batches in the main
  process, as it would on the GPU with ``device="cuda"``. uint8 crosses the object store.
- ``f32``: the same without ``device``: float batches. Process workers finish them into the
  pool slot; Ray's actors ship uint8 batches, and the main process computes the float batch
  into the slot as it lands each one (the tail at landing), so uint8 crosses here too.
- ``overhead``: ``benchmarks/overhead.py``'s case, the loader's own cost: 16 pre-made uint8
  3×224×224 samples cycled, no decoding, batch 128, the consumer touching every page.

Each run is a fresh process (configurations alternate order from repeat to repeat) with
persistent workers: the time to the first batch (``iter()`` to the first ``next()``: a fork,
or an actor whose process starts and imports torch), then images/s over ``--epochs`` epochs
after a warm-up one. Through the object store: images/s × the bytes of an image on the wire.
The table gives medians and the ratio of Ray to processes; the load average (the machine's
other business) is printed before and after. With ``--profile``, each run also reads where the
CPU went over its timed epochs (Linux ``/proc``): the main process, the workers (processes or
actors), Ray's own daemons (raylet, GCS), in cores; and the workers' fetch and collate time per
batch from ``loader.stats()``.

    .venv-clients/bin/python benchmarks/ray_workers.py --images 1000 --repeats 5
    .venv-clients/bin/python benchmarks/ray_workers.py --configs f32-process,f32-ray --profile
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.interleaved import interleaved_rates, pipeline_parser

CASES = ("u8", "f32", "overhead")
BACKENDS = ("process", "ray")
CONFIGS = tuple(f"{case}-{backend}" for case in CASES for backend in BACKENDS)
IMAGE_BYTES = 3 * 224 * 224  # one uint8 image on the wire
WIRE_BYTES = {"u8": IMAGE_BYTES, "f32": IMAGE_BYTES, "overhead": IMAGE_BYTES}  # all uint8
OVERHEAD_BATCH, OVERHEAD_IMAGES = 128, 2048  # an epoch of 16 batches


def cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process (``main``), its workers (child processes, or the
    actors' processes) and Ray's own processes (raylet, GCS, agents, idle workers), read from
    /proc: a Ray process's command line is its title, ``ray::<actor class>`` for an actor."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {"main": 0.0, "workers": 0.0, "Ray daemons": 0.0}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if int(pid) == os.getpid():
            group = "main"
        elif command.startswith("ray::RayWorker"):
            group = "workers"
        elif command.startswith("ray::") or "/ray/" in command:  # ray.init's children too
            group = "Ray daemons"
        elif int(fields[1]) == os.getpid():
            group = "workers"
        else:
            continue
        seconds[group] += (int(fields[11]) + int(fields[12])) / tick
    return seconds


def run(config: str, root: Path, workers: int, batch_size: int, epochs: int,
        profile: bool = False) -> dict[str, Any]:
    """One configuration in this process: its time to the first batch and images/s (and with
    ``profile``, where the CPU went)."""
    import torch

    from fastfeed import FastLoader

    case, backend = config.rsplit("-", 1)
    if backend == "ray":
        import ray

        import benchmarks.overhead

        ray.init(num_cpus=workers, include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False)
        # Its dataset travels by value: the actors do not run from this directory.
        ray.cloudpickle.register_pickle_by_value(benchmarks.overhead)
    consume: Callable[[Any], int]
    if case == "overhead":
        from benchmarks.overhead import FixedSamples, touch

        dataset: Any = FixedSamples(torch.uint8, length=OVERHEAD_IMAGES)
        options: dict[str, Any] = {"batch_size": OVERHEAD_BATCH}

        def consume(batch: Any) -> int:
            touch(batch)
            return len(batch)
    else:
        from fastfeed.bench.data import classic_imagefolder

        dataset = classic_imagefolder(root, accelerated=True)
        options = {"batch_size": batch_size, "device": "cpu" if case == "u8" else None}

        def consume(batch: Any) -> int:
            return len(batch[0])
    loader = FastLoader(dataset, shuffle=True, num_workers=workers, persistent_workers=True,
                        worker_mode=backend, **options)
    start = time.perf_counter()
    iterator = iter(loader)
    consume(next(iterator))
    first_batch_s = time.perf_counter() - start
    for batch in iterator:  # the rest of the warm-up epoch
        consume(batch)
    rates = []
    loader.stats(reset=True)
    cpu_before, timed = cpu_seconds(), time.perf_counter()
    for _ in range(epochs):
        start, images = time.perf_counter(), 0
        for batch in loader:
            images += consume(batch)
        rates.append(images / (time.perf_counter() - start))
    result: dict[str, Any] = {"first_batch_s": first_batch_s, "rates": rates}
    if profile:
        wall, stats = time.perf_counter() - timed, loader.stats()
        result["cores"] = {group: (spent - cpu_before[group]) / wall
                           for group, spent in cpu_seconds().items()}
        result["worker_ms"] = {"fetch": stats.stage_ms["fetch"],
                               "collate": stats.stage_ms["collate"],
                               "busy": 100 * stats.worker_utilization}
    return result


def print_table(runs: dict[str, list[dict[str, Any]]], title: str) -> None:
    def median_rate(config: str) -> float:
        return statistics.median(r for run in runs[config] for r in run["rates"])

    def median_first(config: str) -> float:
        return statistics.median(run["first_batch_s"] for run in runs[config])

    print(title)
    print("| case | process images/s | Ray images/s | Ray / process | first batch process / "
          "Ray | Ray through the object store |\n|---|---|---|---|---|---|")
    for case in CASES:
        process, ray = f"{case}-process", f"{case}-ray"
        if process not in runs or ray not in runs:
            continue
        rate = median_rate(ray)
        print(f"| {case} | {median_rate(process):,.0f} | {rate:,.0f} | "
              f"**{rate / median_rate(process):.2f}×** | {median_first(process):.2f} s / "
              f"{median_first(ray):.2f} s | {rate * WIRE_BYTES[case] / 1e6:,.0f} MB/s |")
    print("\n| configuration | images/s min–max | first batch min–max |\n|---|---|---|")
    for config, values in runs.items():
        rates = [r for run in values for r in run["rates"]]
        firsts = [run["first_batch_s"] for run in values]
        print(f"| {config} | {min(rates):,.0f}–{max(rates):,.0f} | "
              f"{min(firsts):.2f}–{max(firsts):.2f} s |")
    profiled = {c: v for c, v in runs.items() if "cores" in v[0]}
    if profiled:
        # Images per CPU-second: what a shared machine's other load does not skew, where one
        # configuration's processes happen to get more of the cores than another's.
        print("\nWhere the CPU went (medians; cores over the timed epochs; per batch from "
              "stats())\n\n| configuration | main | workers | Ray daemons | images per "
              "CPU-second | workers busy | fetch ms | collate ms |\n|---|---|---|---|---|---|---|"
              "---|")
        for config, values in profiled.items():
            cores = {g: statistics.median(v["cores"][g] for v in values)
                     for g in values[0]["cores"]}
            per_core = statistics.median(statistics.median(v["rates"]) / sum(v["cores"].values())
                                         for v in values)
            ms = {k: statistics.median(v["worker_ms"][k] for v in values)
                  for k in values[0]["worker_ms"]}
            print(f"| {config} | {cores['main']:.2f} | {cores['workers']:.2f} | "
                  f"{cores['Ray daemons']:.2f} | {per_core:,.0f} | {ms['busy']:.0f} % | "
                  f"{ms['fetch']:.0f} | {ms['collate']:.1f} |")


def main() -> None:
    parser = pipeline_parser(__doc__, CONFIGS, batch_size=64)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--profile", action="store_true", help="where the CPU went, per run")
    args = parser.parse_args()

    from fastfeed.bench.data import CACHE

    root = CACHE / f"imagenet-like-{args.images}"
    if args.one:
        print(json.dumps([run(args.one, root, args.workers, args.batch_size, args.epochs,
                              args.profile)]))
        return
    configs = args.configs.split(",")
    if not root.exists() and any(not c.startswith("overhead") for c in configs):
        from fastfeed.vision.synthetic import make_imagefolder

        make_imagefolder(root, args.images, classes=50)
    load_before = os.getloadavg()
    runs = interleaved_rates(__file__, configs, args.repeats,
                             ["--images", str(args.images), "--workers", str(args.workers),
                              "--batch-size", str(args.batch_size), "--epochs",
                              str(args.epochs), *(["--profile"] if args.profile else [])],
                             desc="ray workers")
    load_after = os.getloadavg()
    print_table(runs, f"{args.workers} workers on {os.cpu_count()} cores, {root.name} (batch "
                      f"{args.batch_size}; overhead: batch {OVERHEAD_BATCH}), median of "
                      f"{args.repeats} runs × {args.epochs} epochs")
    print(f"\nload average (1 min) {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
