"""Image pipelines: the stock DataLoader over a plain Pillow dataset against fastfeed.

Classification (224 px random-resized crop + flip) and detection (640 letterbox + flip), with
``--workers`` workers, interleaved over ``--repeats`` runs, medians of images/s:

- ``stock``: torch's DataLoader, a dataset that decodes the whole image with Pillow, crops,
  resizes (bilinear), flips and converts to a CHW tensor; ``default_collate``.
- ``fastfeed``: FastLoader + ``fastfeed.vision`` (window decode with libjpeg-turbo, HWC->CHW
  gather into the slot pool), process workers.
- ``fastfeed-pillow``: the same without the window decoder (Pillow ``draft`` only).
- ``fastfeed-threads``: fastfeed with thread workers.
- ``fastfeed-nvjpeg`` (on a GPU, classification only): workers read bytes, the GPU decodes.

It also times the decoders alone on one core. Data is generated on first use (never
committed) into ``--data``.

    python benchmarks/images.py
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastfeed import FastLoader
from fastfeed.bench.data import PlainPILFolder, PlainPILYolo
from fastfeed.progress import progress
from fastfeed.vision import ImageCollate, ImageFolder, YoloCollate, YoloDataset
from fastfeed.vision.augment import random_resized_crop_box
from fastfeed.vision.synthetic import make_imagefolder, make_yolo
from fastfeed.vision.window_decode import decode_resized_crop


def ensure_data(root: Path, images: int, detection: int) -> tuple[Path, Path]:
    folder, yolo = root / f"imagenet-like-{images}", root / f"yolo-like-{detection}"
    if not folder.exists():
        make_imagefolder(folder, images, classes=50)
    if not yolo.exists():
        make_yolo(yolo, detection)
    return folder, yolo


def loaders(name: str, folder: Path, yolo: Path, args: argparse.Namespace):
    common = {"batch_size": args.batch_size, "num_workers": args.workers, "shuffle": True}
    if name == "fastfeed-nvjpeg":
        from fastfeed.vision import image_loader

        return image_loader(folder, backend="nvjpeg", device="cuda", **common), None
    if name == "stock":
        return (DataLoader(PlainPILFolder(ImageFolder(folder)), **common),
                DataLoader(PlainPILYolo(YoloDataset(yolo)), **dict(common, batch_size=16)))
    mode = "thread" if name == "fastfeed-threads" else "process"
    roi = name != "fastfeed-pillow"
    return (FastLoader(ImageFolder(folder, roi_decode=roi), collate_fn=ImageCollate(),
                       worker_mode=mode, **common),
            FastLoader(YoloDataset(yolo), collate_fn=YoloCollate(), worker_mode=mode,
                       **dict(common, batch_size=16)))


def images_per_s(loader) -> float:
    if loader is None:  # this configuration has no such pipeline
        return float("nan")
    start, count = time.perf_counter(), 0
    for batch in loader:
        count += len(batch["img"] if isinstance(batch, dict) else batch[0])
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # GPU decoding is asynchronous
    return count / (time.perf_counter() - start)


def decoder_rates(folder: Path, count: int = 200, rounds: int = 5) -> dict[str, float]:
    """Single-core decode + 224 random-resized crop, images/s: medians of interleaved rounds."""
    files = sorted(folder.rglob("*.jpg"))[:count]
    blobs = [f.read_bytes() for f in files]
    names = ("pillow-full", "pillow-draft", "libjpeg-turbo-window")
    rates: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            torch.manual_seed(round_)
            rates[name].append(_decode_rate(name, blobs))
    return {name: statistics.median(values) for name, values in rates.items()}


def _decode_rate(name: str, blobs: list[bytes]) -> float:
    """Pillow's whole-image decode and resize (what the stock dataset does), or fastfeed's."""
    start = time.perf_counter()
    for data in blobs:
        if name == "pillow-full":
            image = Image.open(io.BytesIO(data)).convert("RGB")
            x, y, w, h = random_resized_crop_box(*image.size)
            np.asarray(image.resize((224, 224), Image.Resampling.BILINEAR,
                                    box=(x, y, x + w, y + h)))
        else:
            decode_resized_crop(data, random_resized_crop_box, (224, 224),
                                use_roi=name == "libjpeg-turbo-window")
    return len(blobs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path.home() / ".cache" / "fastfeed")
    parser.add_argument("--images", type=int, default=1200)
    parser.add_argument("--detection-images", type=int, default=160)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--configs", nargs="+",
                        default=["stock", "fastfeed", "fastfeed-pillow", "fastfeed-threads"]
                        + (["fastfeed-nvjpeg"] if torch.cuda.is_available() else []))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    folder, yolo = ensure_data(args.data, args.images, args.detection_images)

    decoders = decoder_rates(folder)
    runs: dict[str, dict[str, list[float]]] = {c: {"classify": [], "detect": []}
                                                for c in args.configs}
    order = [(r, c) for r in range(args.repeats)
             for c in (args.configs if r % 2 == 0 else args.configs[::-1])]
    for _, config in progress(order, total=len(order), desc="runs"):
        classify, detect = loaders(config, folder, yolo, args)
        runs[config]["classify"].append(images_per_s(classify))
        runs[config]["detect"].append(images_per_s(detect))

    print("\nDecode + 224 random-resized crop, one core, images/s: "
          + ", ".join(f"{k} {v:.0f}" for k, v in decoders.items()))
    print(f"\n{args.workers} workers; medians of {args.repeats} interleaved epochs "
          f"({args.images} classification images, {args.detection_images} detection images)\n")
    print("| loader | classify 224 img/s | vs stock | detect 640 img/s | vs stock |")
    print("|---|---|---|---|---|")
    medians = {c: {t: statistics.median(v) for t, v in r.items()} for c, r in runs.items()}
    base = medians.get("stock")
    for config, m in medians.items():
        ratio_c = f"**{m['classify'] / base['classify']:.2f}×**" if base else "n/a"
        ratio_d = f"**{m['detect'] / base['detect']:.2f}×**" if base else "n/a"
        print(f"| {config} | {m['classify']:.0f} | {ratio_c} | {m['detect']:.0f} | {ratio_d} |")
    if args.json:
        args.json.write_text(json.dumps({"decoders": decoders, "medians": medians,
                                         "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
