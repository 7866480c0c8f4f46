"""Per-image cost of each stage of the image path, one core: the profile behind its design.

Times, in ms per image over the generated ImageNet-like set: the window decode, resizing the
window with Pillow or with torch (to CHW directly, or back to HWC), and a horizontal flip on
a CHW tensor or an HWC numpy array.

    python benchmarks/image_stages.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastfeed.vision.synthetic import make_imagefolder
from fastfeed.vision.window_decode import _jpeg, jpeg_frame_size, resize


def ms_per_call(fn: Callable[[object], object], items: list, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for item in items:
            fn(item)
        times.append((time.perf_counter() - start) / len(items) * 1e3)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)  # as in a worker
    root = Path.home() / ".cache" / "fastfeed" / "imagenet-like-1200"
    if not root.exists():
        make_imagefolder(root, 1200, classes=50)
    blobs = [f.read_bytes() for f in sorted(root.rglob("*.jpg"))[:100]]
    if _jpeg is None:
        sys.exit("fastfeed._jpeg is not built (libjpeg-turbo headers missing)")

    def window(data: bytes) -> np.ndarray:  # the central 3/4 of the image
        w, h = jpeg_frame_size(data)
        return _jpeg.decode_crop(data, w // 8, h // 8, 3 * w // 4, 3 * h // 4, 224, 224)[0]

    windows = [window(b) for b in blobs]
    chw = [resize(w, (224, 224)) for w in windows]
    hwc = [np.ascontiguousarray(t.permute(1, 2, 0).numpy()) for t in chw]
    stages = {
        "window decode (libjpeg-turbo)": ms_per_call(window, blobs),
        "resize, Pillow BILINEAR (HWC)": ms_per_call(
            lambda w: np.asarray(Image.fromarray(w).resize((224, 224),
                                                           Image.Resampling.BILINEAR)), windows),
        "resize, torch uint8 -> CHW": ms_per_call(lambda w: resize(w, (224, 224)), windows),
        "resize, torch uint8 -> back to HWC": ms_per_call(
            lambda w: np.ascontiguousarray(resize(w, (224, 224)).permute(1, 2, 0).numpy()),
            windows),
        "flip, CHW tensor": ms_per_call(lambda t: t.flip(-1), chw),
        "flip, HWC numpy": ms_per_call(lambda a: np.ascontiguousarray(a[:, ::-1]), hwc),
    }
    print("| stage | ms per image (median of 5) |")
    print("|---|---|")
    for name, ms in stages.items():
        print(f"| {name} | {ms:.3f} |")


if __name__ == "__main__":
    main()
