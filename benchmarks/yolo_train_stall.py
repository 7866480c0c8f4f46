"""The data stall of a real Ultralytics YOLO training run, stock against fastfeed.

``YOLO("yolov8n.yaml").train(...)`` on the generated photo set of
``benchmarks/ultralytics_pipeline.py`` (mosaic kept on, no validation, plots off), one fresh
process per configuration and repeat, configurations alternating order. Callbacks time each
epoch and the wait for every batch: from one ``on_train_batch_end`` to the next
``on_train_batch_start``, which is the trainer's ``for batch in loader`` (Ultralytics reads its
loss values every step, so the GPU has finished the step by then). A first epoch warms up,
then ``--epochs`` are timed; the table gives, per configuration, the medians over every timed
epoch of every run of images/s and of the stall (waited / epoch time), and for FastLoader
configurations what its ``stats()`` say: ms per batch of each stage (on CUDA, the host's time
to enqueue the copy and the GPU ops), the workers' busy share, the slot pool's size and, where NVML
answers, how busy the GPU was.

Configurations: ``stock``; ``patched`` (``fastfeed.ultralytics.patch()``); ``fast``
(``fast_decode``); ``augment`` (``augment_device="cuda"``); ``fast-augment`` (both).

    python benchmarks/yolo_train_stall.py --device 0 --workers 8 --json benchmarks/out/yolo.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.interleaved import interleaved_rates, pipeline_parser

PATCHES: dict[str, dict | None] = {
    "stock": None, "patched": {}, "fast": {"fast_decode": True},
    "augment": {"augment_device": "cuda"},
    "fast-augment": {"fast_decode": True, "augment_device": "cuda"},
}


def train_once(config: str, data_yaml: Path, args: argparse.Namespace) -> list[dict]:
    """Images/s and stall of each timed epoch (after the first), in this process."""
    os.environ["YOLO_OFFLINE"] = "1"
    from ultralytics import YOLO

    import fastfeed.ultralytics

    try:
        import polars  # noqa: F401
    except ImportError:  # the GPU machine has none and cannot download it (a 54 MB wheel)
        from ultralytics.engine.trainer import BaseTrainer

        # Ultralytics imports polars in training only to copy results.csv into checkpoints.
        BaseTrainer.read_results_csv = lambda self: {}  # type: ignore[method-assign]
    options = PATCHES[config]
    if options is not None:
        fastfeed.ultralytics.patch(**options)
    epochs: list[dict] = []
    clock: dict[str, float] = {}

    def epoch_start(trainer) -> None:
        clock.update(start=time.perf_counter(), waited=0.0, images=0)
        clock.pop("batch_end", None)  # the first batch of an epoch also starts the iterator
        if hasattr(trainer.train_loader, "stats"):
            trainer.train_loader.stats(reset=True)

    def batch_start(trainer) -> None:
        if "batch_end" in clock:
            clock["waited"] += time.perf_counter() - clock["batch_end"]

    def batch_end(trainer) -> None:
        clock["images"] += trainer.batch_size
        clock["batch_end"] = time.perf_counter()

    def epoch_end(trainer) -> None:
        elapsed = time.perf_counter() - clock["start"]
        record = {"images_per_s": clock["images"] / elapsed, "stall": clock["waited"] / elapsed}
        if hasattr(trainer.train_loader, "stats"):  # a FastLoader says where its time went
            stats = trainer.train_loader.stats()
            record.update(stage_ms=stats.stage_ms, workers_busy=stats.worker_utilization,
                          ring_mb=stats.slot_mb, gpu_busy=[g.utilization for g in stats.gpu])
        epochs.append(record)

    model = YOLO("yolov8n.yaml")
    for event, callback in [("on_train_epoch_start", epoch_start),
                            ("on_train_batch_start", batch_start),
                            ("on_train_batch_end", batch_end),
                            ("on_train_epoch_end", epoch_end)]:
        model.add_callback(event, callback)
    model.train(data=str(data_yaml), epochs=args.epochs + 1, imgsz=args.imgsz,
                batch=args.batch_size, workers=args.workers, device=args.device, close_mosaic=0,
                val=False, plots=False, amp=args.device != "cpu", project=str(args.project),
                name=config, exist_ok=True, verbose=False)
    return epochs[1:]


def loader_summary(epochs: list[dict]) -> str:
    """ms per batch of each loader stage, workers' busy share, ring size and GPU busy share."""
    epochs = [e for e in epochs if "stage_ms" in e]
    if not epochs:
        return ""
    stages = ", ".join(f"{stage} {statistics.median(e['stage_ms'][stage] for e in epochs):.1f}"
                       for stage in epochs[0]["stage_ms"])
    line = (f"ms per batch: {stages}; workers "
            f"{statistics.median(e['workers_busy'] for e in epochs):.0%} busy; ring "
            f"{statistics.median(e['ring_mb'] for e in epochs):.0f} MB")
    if epochs[0]["gpu_busy"]:
        line += f"; GPU {statistics.median(e['gpu_busy'][0] for e in epochs):.0f} % busy"
    return line


def main() -> None:
    parser = pipeline_parser(__doc__, list(PATCHES), batch_size=16)
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--device", default="0")
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--widths", default="1280,1920")
    parser.add_argument("--data-yaml", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--project", type=Path, default=Path("/tmp/fastfeed-yolo-stall"))
    args = parser.parse_args()

    if args.one:
        print(json.dumps(train_once(args.one, args.data_yaml, args)))
        return

    from benchmarks.ultralytics_pipeline import make_photo_yolo
    from fastfeed.bench.data import CACHE

    lo, hi = (int(w) for w in args.widths.split(","))
    root = CACHE / f"yolo-photos-{args.images}-{lo}-{hi}"
    if not root.exists():
        make_photo_yolo(root, args.images, (lo, hi))
    data_yaml = root / "data.yaml"
    data_yaml.write_text(f"path: {root}\ntrain: images\nval: images\nnames:\n"
                         + "".join(f"  {i}: c{i}\n" for i in range(8)))
    results = interleaved_rates(
        __file__, args.configs.split(","), args.repeats,
        ["--data-yaml", str(data_yaml), "--epochs", str(args.epochs), "--imgsz", str(args.imgsz),
         "--batch-size", str(args.batch_size), "--workers", str(args.workers), "--device",
         args.device, "--project", str(args.project)],
        desc="yolo training")
    print(f"\nyolov8n training, {root.name}, imgsz {args.imgsz}, batch {args.batch_size}, "
          f"{args.workers} workers, device {args.device}: medians of {args.repeats} runs × "
          f"{args.epochs} timed epochs\n")
    print("| loader | images/s | vs stock | data stall | FastLoader's stats, medians per epoch "
          "|\n|---|---|---|---|---|")
    medians = {c: {k: statistics.median(e[k] for e in epochs) for k in ("images_per_s", "stall")}
               for c, epochs in results.items()}
    base = medians.get("stock", {}).get("images_per_s")
    for config, m in medians.items():
        ratio = f"{m['images_per_s'] / base:.2f}×" if base else "n/a"
        print(f"| {config} | {m['images_per_s']:,.0f} | {ratio} | {100 * m['stall']:.1f} % "
              f"| {loader_summary(results[config])} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": results, "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
