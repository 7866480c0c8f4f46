"""``fastfeed bench``: the stock DataLoader against FastLoader, on your data.

Configurations run interleaved, each measurement in a fresh process, and the medians of
``--repeats`` are reported: throughput, speedup against stock at the same worker count, the
data stall (share of wall time spent waiting for a batch), time to the first batch, and peak
RSS (main process plus its largest worker); the stall only with ``--step-ms`` or ``--model``,
since a loop that only waits for data stalls near 100 % whatever the loader. Writes
``bench.json`` and, with matplotlib (``pip install matplotlib``), ``bench.png`` to ``--out``.

Every configuration says what it changes against its baseline (the ``changes`` column):
``loader`` alone, or the dataset and transforms too, so that a dataset swap's speed-up is never
read as the loader's.

Configurations: ``stock`` (torch's DataLoader; for image folders, over a plain Pillow dataset),
``fastfeed`` (FastLoader with the same arguments; for image folders, fastfeed's own
window-decoding dataset and transforms: loader, dataset and transforms change) and
``fastfeed+device`` (with ``--device``: device prefetch and a GPU-side Normalize). With
torchvision installed, image folders also run the user's view, where only what the row names
changes:
``torchvision`` (torch's DataLoader over torchvision's ``ImageFolder`` with the classic
RandomResizedCrop/flip/ToTensor/Normalize transforms), ``torchvision+swap`` (FastLoader, same
arguments) and ``torchvision+accelerate`` (FastLoader over :func:`fastfeed.vision.accelerate`
of that dataset), each compared with ``torchvision``. Image folders also run ``dali`` when
NVIDIA DALI is installed (a note says so when it is not): its ResNet-50 recipe, which gives
the same normalised float batches as the classic transforms, so it is compared with
``torchvision`` too; on the CPU with its CPU operators and ``--workers`` threads, as
``benchmarks/torchvision_pipeline.py`` runs it (``fastfeed/bench/peers.py``), with
``--device cuda`` decoding on the GPU (uint8 batches).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from fastfeed._install import install_line
from fastfeed.bench.data import (
    TORCHVISION_CONFIGS,
    BenchError,
    changes,
    changes_note,
    resolve,
    torchvision_available,
)
from fastfeed.bench.peers import PEERS
from fastfeed.bench.report import missing_baselines, write_chart, write_json, write_table
from fastfeed.bench.run import Job, run_in_child
from fastfeed.progress import progress

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter  # --help shows defaults
    parser.add_argument("--data", default="synthetic",
                        help="synthetic | imagenet-like | PATH (ImageFolder or YOLO) | "
                             "module:function (returns a Dataset)")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per batch")
    parser.add_argument("--workers", default="2",
                        help="a count, a comma-separated list (0,2,4) or auto")
    parser.add_argument("--device", default=None, help="cuda or cpu: also run FastLoader "
                        "with device= and a GPU-side Normalize")
    parser.add_argument("--batches", type=int, default=50, help="batches per measurement")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="simulate a model step of this many milliseconds per batch")
    parser.add_argument("--model", choices=["resnet50", "yolo-like", "tiny"],
                        help="run a real training step instead of --step-ms")
    parser.add_argument("--repeats", type=int, default=3,
                        help="measurements per configuration (the median is shown)")
    parser.add_argument("--images", type=int, default=1000,
                        help="size of the generated imagenet-like set")
    parser.add_argument("--out", type=Path, default=Path("fastfeed-bench"),
                        help="where bench.json and bench.png go")


def _workers(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    for value in values:
        if value != "auto" and not value.isdigit():
            raise BenchError(f"--workers {text}: expected counts like 2 or 0,2,4, or auto")
    return values


def run(args: argparse.Namespace) -> int:
    """Run the comparison; bad input is reported in one line (exit status 2)."""
    try:
        workers = _workers(args.workers)
        if args.batch_size <= 0 or args.batches <= 0 or args.repeats <= 0:
            raise BenchError("--batch-size, --batches and --repeats must be positive")
        if args.device not in (None, "cpu", "cuda") and not str(args.device).startswith("cuda:"):
            raise BenchError(f"--device {args.device}: expected cpu or cuda")
        source = resolve(args.data, args.images)
        args.out.mkdir(parents=True, exist_ok=True)
    except BenchError as error:
        print(f"fastfeed bench: error: {error}", file=sys.stderr)
        return 2

    configs = ["stock", "fastfeed"] + (["fastfeed+device"] if args.device else [])
    if source.kind == "classify" and torchvision_available():
        configs += TORCHVISION_CONFIGS
    if source.kind == "classify":
        if PEERS["dali-cpu"].missing() is None:
            configs.append("dali")
        else:
            print(f"dali: not installed, left out ({install_line('dali')})")
    plan = [(c, w) for w in workers for c in configs]
    jobs = [(r, c, w) for r in range(args.repeats)
            for c, w in (plan if r % 2 == 0 else plan[::-1])]
    samples: dict[tuple[str, str], list[dict[str, float]]] = {p: [] for p in plan}
    for _, config, count in progress(jobs, total=len(jobs), desc="fastfeed bench"):
        job = Job(args.data, args.images, config, count, args.batch_size, args.batches,
                  args.device, args.step_ms, args.model)
        try:
            samples[(config, count)].append(run_in_child(job))
        except RuntimeError as error:
            print(f"fastfeed bench: error: {error}", file=sys.stderr)
            return 1

    results: list[dict[str, Any]] = [
        {"config": config, "workers": count, "changes": changes(config, source.kind),
         **{key: statistics.median(m[key] for m in runs) for key in runs[0]}}
        for (config, count), runs in samples.items()]
    step = f"model {args.model}" if args.model else f"step {args.step_ms:g} ms"
    title = (f"{source.description}: batch {args.batch_size}, {step}, medians of "
             f"{args.repeats}")
    with_stall = bool(args.model or args.step_ms)
    write_table(results, title, with_stall)
    note = changes_note(results)
    if note is not None:
        print(note)
    # Stock always runs: a missing baseline is torchvision's, which did not import.
    for config, family in missing_baselines(results).items():
        print(f"*{config}: no speed-up: it is compared with the {family} row, which did not "
              f"run (torchvision does not import here: {install_line('torchvision')})")
    if not with_stall:
        print("data stall: not shown without a training step; add --step-ms or --model")
    write_json(results, {"args": {k: str(v) for k, v in vars(args).items()}, "title": title},
               args.out / "bench.json")
    charted = write_chart(results, title, args.out / "bench.png", with_stall)
    print(f"wrote {args.out / 'bench.json'}"
          + (f" and {args.out / 'bench.png'}" if charted else
             f" (for a chart: {install_line('plot')})"))
    return 0
