"""Where the wall clock goes in Ultralytics' YOLO training data path: per process, per stage.

One configuration of ``ultralytics_pipeline.py`` (``stock``, ``patched``, ``patched-fast``) over
its large photos, in this process: a warm-up epoch, then ``--epochs`` timed ones. For each: the
images per second of wall time, how many cores the loader's processes kept busy (CPU seconds
of the main process and of each worker over the wall time), how long the training loop waited
in ``next()``, and for fastfeed its ``stats()``: worker utilisation and milliseconds per batch of
fetching (Ultralytics' decode, mosaic, warp) and collating. Idle cores would show as fewer than
``--workers`` busy; a main-process bottleneck as a busy main process.

    .venv-clients/bin/python benchmarks/yolo_where.py stock
    .venv-clients/bin/python benchmarks/yolo_where.py patched-fast --epochs 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ultralytics_pipeline import PATCHES, make_photo_yolo


def cpu_by_process() -> dict[str, float]:
    """CPU seconds so far of this process (``main``) and of each live worker."""
    import psutil  # an Ultralytics dependency

    me = psutil.Process()
    seconds = {"main": sum(me.cpu_times()[:2])}
    for child in me.children(recursive=True):
        try:
            seconds[f"worker {child.pid}"] = sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            continue
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", choices=["stock", *PATCHES])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--images", type=int, default=400)
    args = parser.parse_args()

    os.environ["YOLO_OFFLINE"] = "1"
    import torch
    from ultralytics.cfg import get_cfg
    from ultralytics.data import build_dataloader, build_yolo_dataset
    from ultralytics.utils import DEFAULT_CFG

    import fastfeed.ultralytics
    from fastfeed.bench.data import CACHE

    root = CACHE / f"yolo-photos-{args.images}-1280-1920"
    if not root.exists():
        make_photo_yolo(root, args.images, (1280, 1920))
    if args.config != "stock":
        fastfeed.ultralytics.patch(**PATCHES[args.config])
    torch.manual_seed(0)
    cfg = get_cfg(DEFAULT_CFG, {"imgsz": 640, "cache": False})
    data = {"names": {i: str(i) for i in range(8)}, "nc": 8, "channels": 3}
    dataset = build_yolo_dataset(cfg, str(root / "images"), 16, data, mode="train")
    loader = build_dataloader(dataset, 16, args.workers, shuffle=True, rank=-1)
    for epoch in range(args.epochs + 1):
        if epoch == 1 and hasattr(loader, "stats"):
            loader.stats(reset=True)  # the warm-up epoch's worker start-up left out
        start, cpu, images, waited = time.perf_counter(), cpu_by_process(), 0, 0.0
        iterator = iter(loader)
        while True:
            asked = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                break
            waited += time.perf_counter() - asked
            images += len(batch["im_file"])
        wall = time.perf_counter() - start
        busy = {k: (v - cpu.get(k, 0.0)) / wall for k, v in cpu_by_process().items()}
        if epoch:
            print(f"{args.config} epoch {epoch}: {images / wall:.0f} images/s (wall), "
                  f"{sum(busy.values()):.2f} cores busy (main {busy['main']:.2f}), the loop "
                  f"waited {waited / wall:.0%} of the epoch")
    if hasattr(loader, "stats"):
        stats = loader.stats()
        stages = ", ".join(f"{k} {v:.1f} ms" for k, v in stats.stage_ms.items() if v)
        print(f"{args.config} per batch of 16: {stages}; workers "
              f"{stats.worker_utilization:.0%} busy")
    loader.close()


if __name__ == "__main__":
    main()
