"""Ultralytics' own YOLO training data path under its stock loader and under fastfeed.

Ultralytics' ``YOLODataset`` in train mode (mosaic, random perspective, HSV, flip) at
``--imgsz``, built by its own ``build_dataset``/``build_dataloader``, batch 16, shuffled, with its
collate_fn, seed_worker and seeded generator: the loader ``model.train()`` iterates.
Configurations:

- ``stock``: Ultralytics' ``InfiniteDataLoader`` (a ``torch.utils.data.DataLoader``).
- ``swap``: the plain import swap: Ultralytics' own ``InfiniteDataLoader`` class on top of
  ``FastLoader`` instead of ``DataLoader``, nothing else changed.
- ``patched``: after ``fastfeed.ultralytics.patch()`` (the one line).
- ``patched-fast``: ``patch(fast_decode=True)``: large JPEGs decoded at a reduced DCT scale.
- ``patched-threads``: ``patch(worker_mode="thread")`` (not in the default set).
- ``patched-augment``, ``patched-fast-augment``: ``patch(augment_device="cuda")`` (with and
  without ``fast_decode``): the warp, HSV and flips run on the GPU (not in the default set; on a
  GPU machine only).
- ``stock-ram``, ``patched-ram``, ``patched-shared``: Ultralytics' ``cache="ram"`` (every image
  decoded once, per process, before training), under the stock loader, under ``patch()``, and
  under ``patch(cache="shared")`` (one copy per machine, filled by whichever process decodes an
  image first); not in the default set.
- ``augment-feed``, ``fast-augment-feed``: a diagnostic for CPU-only machines: the workers'
  side of ``augment_device`` (parameters recorded, canvases shipped) with the device ops
  skipped, so the images are *not* augmented: the rate at which the CPU could feed a GPU that
  keeps up.

Each run is a fresh process: one warm-up epoch (workers start, mosaic buffers fill), then
``--epochs`` timed epochs; configurations alternate order from repeat to repeat. Two tables give
the medians over every timed epoch of every repeat: images per second of wall time, and images
per CPU-second of the loader's processes (the main process and its workers), which stays
meaningful when other work shares the machine: the time a configuration costs, not the time
it waited for a core.

The images are photographs, not drawings: collages of Ultralytics' own sample photos
(``bus.jpg``, ``zidane.jpg``) with mild sensor noise, JPEG q90, about 2 bits per pixel as
camera JPEGs are; 1 to 7 labelled boxes each. Generated on first use, never committed.

    python benchmarks/ultralytics_pipeline.py --pixels --json benchmarks/out/yolo-large.json
        # writes benchmarks/out/yolo-large.wall.json and yolo-large.cpu.json
    python benchmarks/ultralytics_pipeline.py --widths 480,800 --json benchmarks/out/yolo-small.json
    python benchmarks/ultralytics_pipeline.py --configs stock-ram,patched-ram,patched-shared
    python benchmarks/ultralytics_pipeline.py --profile      # ms per sample, per OpenCV call
    python benchmarks/ultralytics_pipeline.py --ops-device cuda  # the batch pixel ops alone
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.interleaved import interleaved_rates, pipeline_parser, print_ratio_table

CONFIGS = ("stock", "swap", "patched", "patched-fast")
PATCHES = {"patched": {}, "patched-fast": {"fast_decode": True},
           "patched-ram": {}, "patched-shared": {"cache": "shared"},
           "patched-threads": {"worker_mode": "thread"},
           "patched-augment": {"augment_device": "cuda"},
           "patched-fast-augment": {"fast_decode": True, "augment_device": "cuda"},
           "augment-feed": {"augment_device": "cpu"},
           "fast-augment-feed": {"fast_decode": True, "augment_device": "cpu"}}


def make_photo_yolo(root: Path, images: int, widths: tuple[int, int], seed: int = 0) -> Path:
    """``root/images/*.jpg`` + ``root/labels/*.txt``: collages of Ultralytics' sample photos."""
    import cv2
    import ultralytics

    from fastfeed.progress import progress

    assets = Path(ultralytics.__file__).parent / "assets"
    photos = [cv2.imread(str(assets / name)) for name in ("bus.jpg", "zidane.jpg")]
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "labels").mkdir(parents=True, exist_ok=True)
    for i in progress(range(images), total=images, desc=f"photos -> {root}"):
        width = int(rng.integers(widths[0], widths[1] + 1))
        height = int(width * rng.uniform(0.56, 0.75))
        canvas = np.empty((height, width, 3), np.uint8)
        x = 0
        while x < width:  # vertical strips cut from a randomly scaled, maybe mirrored photo
            photo = photos[rng.integers(len(photos))]
            scale = height / photo.shape[0] * rng.uniform(1.0, 1.5)
            tile = cv2.resize(photo, (int(photo.shape[1] * scale) + 1,
                                      int(photo.shape[0] * scale) + 1))
            top = int(rng.integers(0, tile.shape[0] - height + 1))
            strip_width = min(int(rng.integers(width // 4, width // 2 + 1)), tile.shape[1],
                              width - x)
            left = int(rng.integers(0, tile.shape[1] - strip_width + 1))
            strip = tile[top:top + height, left:left + strip_width]
            canvas[:, x:x + strip_width] = strip[:, ::-1] if rng.random() < 0.5 else strip
            x += strip_width
        noisy = np.clip(canvas + rng.normal(0, 2, canvas.shape), 0, 255).astype(np.uint8)
        cv2.imwrite(str(root / "images" / f"{i:05d}.jpg"), noisy, [cv2.IMWRITE_JPEG_QUALITY, 90])
        rows = []
        for _ in range(int(rng.integers(1, 8))):
            w, h = rng.uniform(0.05, 0.4, size=2)
            cx, cy = rng.uniform(w / 2, 1 - w / 2), rng.uniform(h / 2, 1 - h / 2)
            rows.append(f"{int(rng.integers(8))} {cx:.6f} {cy:.6f} {w:.6f} {h:.6f}")
        (root / "labels" / f"{i:05d}.txt").write_text("\n".join(rows) + "\n")
    return root


def cpu_seconds() -> float:
    """CPU time (user + system) so far of this process and its live children (the workers):
    what a run costs, whatever else the machine runs meanwhile."""
    import psutil  # an Ultralytics dependency

    me = psutil.Process()
    total = 0.0
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def images_per_s(config: str, root: Path, imgsz: int, workers: int, batch_size: int,
                 epochs: int, cache: str = "") -> list[dict[str, float]]:
    """Each timed epoch of one configuration (run in this process): images per second of wall
    time (``wall``) and per CPU-second of this process and its workers (``cpu``)."""
    os.environ["YOLO_OFFLINE"] = "1"
    import torch
    from ultralytics.cfg import get_cfg
    from ultralytics.data import build_dataloader, build_yolo_dataset
    from ultralytics.utils import DEFAULT_CFG

    import fastfeed.ultralytics

    if config == "swap":
        from ultralytics.data import build

        from fastfeed import FastLoader

        bases = (build.InfiniteDataLoader, FastLoader)  # its super() is now FastLoader
        build.InfiniteDataLoader = type("InfiniteDataLoader", bases, {})
    elif not config.startswith("stock"):
        fastfeed.ultralytics.patch(**PATCHES[config])
    if config.endswith(("-ram", "-shared")):
        cache = "ram"
    if config.endswith("augment-feed"):
        from fastfeed.ultralytics import gpu_augment

        gpu_augment.PixelOps.__call__ = lambda self, batch: batch  # type: ignore[method-assign]
    torch.manual_seed(0)
    cfg = get_cfg(DEFAULT_CFG, {"imgsz": imgsz, "cache": cache or False})
    data = {"names": {i: str(i) for i in range(8)}, "nc": 8, "channels": 3}
    dataset = build_yolo_dataset(cfg, str(root / "images"), batch_size, data, mode="train")
    loader = build_dataloader(dataset, batch_size, workers, shuffle=True, rank=-1)
    rates = []
    for epoch in range(epochs + 1):
        start, cpu, images = time.perf_counter(), cpu_seconds(), 0
        for batch in loader:
            images += len(batch["im_file"])  # the feed configs leave "img" packed
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # batches made on the GPU count when they are done
        if epoch:
            rates.append({"wall": images / (time.perf_counter() - start),
                          "cpu": images / (cpu_seconds() - cpu)})
    loader.close()
    return rates


def pixel_difference(root: Path, imgsz: int, images: int = 100) -> str:
    """How far ``fast_decode`` images are from Ultralytics' own, per image (grey levels)."""
    import cv2
    from ultralytics.utils.patches import imread

    from fastfeed.ultralytics.reduced_decode import _decode, target_size

    means = []
    for path in sorted((root / "images").glob("*.jpg"))[:images]:
        full = imread(str(path))
        stock = cv2.resize(full, target_size(*full.shape[:2], imgsz),
                           interpolation=cv2.INTER_LINEAR)
        fast = _decode(str(path), imgsz)
        assert fast is not None and fast[0].shape == stock.shape
        means.append(float(np.abs(fast[0].astype(np.int16) - stock.astype(np.int16)).mean()))
    return (f"fast_decode against Ultralytics' decode, {len(means)} images of {root.name} at "
            f"imgsz {imgsz}: mean |Δ| per image: median {np.median(means):.2f}, "
            f"max {max(means):.2f} grey levels")


# Each stage's calls in cProfile: (file, function) for Python, ("~", part of the name) for
# built-ins (OpenCV's functions, numpy's, fastfeed's kernels).
STAGES = {
    "decode": [("~", "imdecode"), ("~", "fromfile"), ("~", "'read' of '_io.BufferedReader'")],
    "resize": [("~", "<resize>")],
    "mosaic": [("augment.py", "apply_image@Mosaic"), ("numeric.py", "full"),
               ("mosaic.py", "render")],
    "warp": [("~", "warpAffine"), ("~", "warp_axis_aligned")],
    # One stage: patch() applies the jitter while it gathers the batch (gather_jittered).
    "HSV + format + collate": [("~", "cvtColor"), ("~", "<LUT>"), ("~", "hsv_jitter"),
                               ("~", "ascontiguousarray"), ("~", "torch.stack"),
                               ("~", "gather_hwc_to_chw"), ("~", "gather_jittered")],
}


def _stage_times(stats: dict, samples: int) -> dict[str, float]:
    """Milliseconds per sample of each of :data:`STAGES` (own time of its calls), and of the
    rest (Python and small calls), from cProfile's ``stats``."""
    total = sum(tottime for _, _, tottime, _, _ in stats.values())
    times = dict.fromkeys(STAGES, 0.0)
    for (path, line, name), (_, _, tottime, _, _) in stats.items():
        if name == "apply_image" and path.endswith("augment.py") and 599 <= line < 632:
            name = "apply_image@Mosaic"  # Ultralytics 8.4's Mosaic.apply_image
        for stage, entries in STAGES.items():
            if any(name == n and path.endswith(p) if p != "~" else path == "~" and n in name
                   for p, n in entries):
                times[stage] += tottime
    # fast_decode's shrink runs the warp's kernel through warp._run (which the warp of these
    # pipelines, always on a mosaic, does not take): that share of the kernel is the resize's.
    kernel = sum(entry[2] for (path, _, name), entry in stats.items()
                 if path == "~" and "warp_axis_aligned" in name)
    for (path, _, name), (_, _, _, cumtime, callers) in stats.items():
        if name == "_run_tiles" and path.endswith("warp.py") and cumtime > 0:
            shrink = sum(edge[3] for (_, _, caller), edge in callers.items() if caller == "_run")
            times["resize"] += kernel * shrink / cumtime
            times["warp"] -= kernel * shrink / cumtime
    times["rest (Python)"] = total - sum(times.values())
    return {stage: t / samples * 1e3 for stage, t in times.items()}


def _reused_empty() -> Any:
    """An ``empty(shape, dtype)`` that hands out the same tensor for the same request."""
    import torch

    tensors: dict[tuple, torch.Tensor] = {}

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        if key not in tensors:
            tensors[key] = torch.empty(shape, dtype=dtype)
        return tensors[key]

    return empty


def profile_samples(root: Path, imgsz: int, samples: int = 320) -> str:
    """Where one process spends a training sample's CPU time, per stage (cProfile, batches of 16
    formatted and collated as each configuration's workers do), and what ``imdecode`` costs at
    each DCT scale."""
    import cProfile
    import pstats

    import cv2
    import torch

    torch.set_num_threads(1)  # as in a loader's worker
    os.environ["YOLO_OFFLINE"] = "1"
    from ultralytics.cfg import get_cfg
    from ultralytics.data import build_yolo_dataset
    from ultralytics.utils import DEFAULT_CFG

    import fastfeed.ultralytics
    from fastfeed.ultralytics.gpu_augment import defer_pixel_ops
    from fastfeed.ultralytics.infinite_loader import prepare_worker
    from fastfeed.ultralytics.slot_collate import SlotCollate

    variants = {"stock": (None, False), "patch()": ({}, False),
                "fast_decode": ({"fast_decode": True}, False),
                "pixel work deferred (augment_device)": ({}, True),
                "fast_decode + deferred": ({"fast_decode": True}, True)}
    lines = []
    for name, (options, defer) in variants.items():
        fastfeed.ultralytics.unpatch()
        if options is not None:
            fastfeed.ultralytics.patch(**options)
        data = {"names": {i: str(i) for i in range(8)}, "nc": 8, "channels": 3}
        dataset = build_yolo_dataset(get_cfg(DEFAULT_CFG, {"imgsz": imgsz}),
                                     str(root / "images"), 16, data, mode="train")
        collate = dataset.collate_fn
        if defer:
            defer_pixel_ops(dataset)
        elif options is not None:  # as the patched loader's workers do
            prepare_worker(dataset)
            collate = SlotCollate(collate)
        # Indices wrap: a small --images set still gives the 20 warm-up and ``samples`` timed.
        for i in range(20):  # fill the mosaic buffer
            dataset[i % len(dataset)]
        empty = _reused_empty()  # as a loader's pool slots, written again batch after batch
        # CPU time, not wall time: the figures hold while other work shares the machine.
        profiler = cProfile.Profile(time.process_time)
        start = time.process_time()
        profiler.enable()
        for first in range(20, 20 + samples, 16):
            batch = [dataset[i % len(dataset)] for i in range(first, first + 16)]
            if not defer:
                collate(batch) if options is None else collate.collate_into(batch, empty)
        profiler.disable()
        per_sample = (time.process_time() - start) / samples * 1e3
        stages = _stage_times(pstats.Stats(profiler).stats, samples)  # type: ignore[attr-defined]
        lines.append(f"{name}: {per_sample:.1f} CPU ms per sample; "
                     + ", ".join(f"{stage} {t:.2f}" for stage, t in stages.items()))
    fastfeed.ultralytics.unpatch()
    files = [np.fromfile(p, np.uint8) for p in sorted((root / "images").glob("*.jpg"))[:60]]
    scales = {"full": cv2.IMREAD_COLOR, "1/2": cv2.IMREAD_REDUCED_COLOR_2,
              "1/4": cv2.IMREAD_REDUCED_COLOR_4, "1/8": cv2.IMREAD_REDUCED_COLOR_8}
    costs = []
    for name, flag in scales.items():
        start = time.process_time()
        for data in files:
            cv2.imdecode(data, flag)
        costs.append(f"{name} {(time.process_time() - start) / len(files) * 1e3:.2f}")
    lines.append("imdecode ms per image (CPU time): " + ", ".join(costs))
    return "\n".join(lines)


def main() -> None:
    parser = pipeline_parser(__doc__, CONFIGS, batch_size=16)
    parser.add_argument("--data", type=Path, default=None,
                        help="a YOLO folder with images/ and labels/ (default: generated)")
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--widths", default="1280,1920", help="generated image widths: lo,hi")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--pixels", action="store_true",
                        help="also measure how far fast_decode pixels are from Ultralytics'")
    parser.add_argument("--profile", action="store_true",
                        help="only profile samples in this process (ms per call), no loaders")
    parser.add_argument("--ops-device", help="only time the augment_device pixel ops there")
    parser.add_argument("--cache", choices=["", "ram"], default="",
                        help="Ultralytics' image cache: 'ram' decodes every image once, up front")
    args = parser.parse_args()
    if args.ops_device:
        from benchmarks.pixel_ops_timing import device_ops_ms

        print(device_ops_ms(args.ops_device, args.imgsz, args.batch_size))
        return

    if args.one:
        print(json.dumps(images_per_s(args.one, args.data, args.imgsz, args.workers,
                                      args.batch_size, args.epochs, args.cache)))
        return

    from fastfeed.bench.data import CACHE

    lo, hi = (int(w) for w in args.widths.split(","))
    root = args.data
    if root is None:
        root = CACHE / f"yolo-photos-{args.images}-{lo}-{hi}"
        if not root.exists():
            make_photo_yolo(root, args.images, (lo, hi))
    if args.profile:
        print(profile_samples(root, args.imgsz))
        return
    rates = interleaved_rates(
        __file__, args.configs.split(","), args.repeats,
        ["--data", str(root), "--imgsz", str(args.imgsz), "--workers", str(args.workers),
         "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
         "--cache", args.cache],
        desc="ultralytics pipeline")
    title = (f"Ultralytics YOLODataset (train augmentations), {root.name}, imgsz {args.imgsz}"
             f"{', images cached in RAM' if args.cache else ''}: "
             f"batch {args.batch_size}, {args.workers} workers, median of {args.repeats} runs × "
             f"{args.epochs} epochs, load average {os.getloadavg()[0]:.1f} at the end")
    for metric, unit in (("wall", "images/s"), ("cpu", "images per CPU-second")):
        json_path = args.json and args.json.with_suffix(f".{metric}.json")
        print_ratio_table(f"{title}: {unit}",
                          {c: [r[metric] for r in records] for c, records in rates.items()},
                          unit=unit, json_path=json_path)
    if args.pixels:
        print(pixel_difference(root, args.imgsz))


if __name__ == "__main__":
    main()
