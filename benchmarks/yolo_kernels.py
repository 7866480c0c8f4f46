"""The two pixel kernels of ``fastfeed.ultralytics.patch()`` against the OpenCV calls they
replace, on one core: thread time per 640×640 image, medians.

- **HSV**: ``gather_jittered`` (the jitter and the batch's ``HWC -> CHW`` gather in one pass)
  against ``cv2.cvtColor``, ``cv2.LUT``, ``cv2.cvtColor`` and the transposing copy; and
  ``hsv_gathered_ms``, the kernel under tables of random entries, which it gathers where it
  computes the entries of the tables Ultralytics draws.
- **warp**: the separable warp of a four-image mosaic straight from its tiles against
  ``cv2.warpAffine`` of the laid-out 1280×1280 canvas, at Ultralytics' scales 0.5 to 1.5.

Each output is checked equal to OpenCV's. The last line is JSON (for ``ab_trees.py``)::

    .venv-clients/bin/python benchmarks/yolo_kernels.py
    .venv-clients/bin/python benchmarks/ab_trees.py --trees before=/tmp/before after=. \\
        --key hsv_ms -- yolo_kernels.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastfeed.collate import torch_empty
from fastfeed.ultralytics.hsv import draw_lut, gather_jittered
from fastfeed.ultralytics.warp import BORDER, _run_tiles, _tile

SIZE, BATCH, REPEATS = 640, 16, 9


def thread_ms(run: Callable[[], object], per: int) -> float:
    """Median thread time of ``run`` over ``REPEATS`` calls, per item (``per`` items a call)."""
    times = []
    for _ in range(REPEATS):
        start = time.thread_time()
        run()
        times.append(1000 * (time.thread_time() - start) / per)
    return statistics.median(times)


def photo(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Smooth noise: runs of near colours, as in a photo."""
    noise = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    return np.ascontiguousarray(cv2.GaussianBlur(noise, (0, 0), 2))


def hsv(rng: np.random.Generator) -> dict[str, float]:
    from ultralytics.data.augment import RandomHSV

    images = [photo(rng, (SIZE, SIZE)) for _ in range(BATCH)]
    tables = [draw_lut(RandomHSV(0.015, 0.7, 0.4)) for _ in images]

    def opencv() -> np.ndarray:
        out = np.empty((BATCH, 3, SIZE, SIZE), np.uint8)
        for i, (image, table) in enumerate(zip(images, tables, strict=True)):
            jittered = cv2.cvtColor(image, cv2.COLOR_BGR2HSV)
            jittered = cv2.LUT(jittered, np.ascontiguousarray(table.T).reshape(1, 256, 3))
            out[i] = cv2.cvtColor(jittered, cv2.COLOR_HSV2BGR).transpose(2, 0, 1)
        return out

    # One batch written again and again, as a worker writes its slot: a fresh one each call
    # would time the first touch of its pages too.
    batch = torch_empty((BATCH, 3, SIZE, SIZE), torch.uint8)

    def into_batch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return batch

    def kernel() -> np.ndarray:
        return gather_jittered(images, tables, into_batch, [False] * BATCH).numpy()

    # Tables of random entries, which the kernel gathers where it computes Ultralytics' ones.
    scattered = [rng.integers(0, 256, (3, 256), dtype=np.uint8) for _ in images]
    for table in scattered:
        table[0] %= 180

    def kernel_gathering() -> np.ndarray:
        return gather_jittered(images, scattered, into_batch, [False] * BATCH).numpy()

    assert np.array_equal(kernel(), opencv()), "the HSV kernel's bytes differ from OpenCV's"
    return {"hsv_ms": thread_ms(kernel, BATCH), "hsv_opencv_ms": thread_ms(opencv, BATCH),
            "hsv_gathered_ms": thread_ms(kernel_gathering, BATCH)}


def warp(rng: np.random.Generator) -> dict[str, float]:
    images = [photo(rng, (427, SIZE)) for _ in range(4)]
    corners = [(213, 0), (213, SIZE), (SIZE, 0), (SIZE, SIZE)]
    canvas = np.full((2 * SIZE, 2 * SIZE, 3), BORDER, np.uint8)
    for image, (y, x) in zip(images, corners, strict=True):
        canvas[y:y + image.shape[0], x:x + image.shape[1]] = image
    tiles = [_tile(image, y, x) for image, (y, x) in zip(images, corners, strict=True)]
    matrices = []
    for _ in range(REPEATS):
        scale = rng.uniform(0.5, 1.5)
        matrices.append(np.array([[scale, 0, rng.uniform(-300, 0)],
                                  [0, scale, rng.uniform(-300, 0)]]))

    def opencv() -> list[np.ndarray]:
        return [cv2.warpAffine(canvas, m, (SIZE, SIZE), borderValue=(BORDER,) * 3)
                for m in matrices]

    def kernel() -> list[np.ndarray]:
        return [_run_tiles(tiles, canvas.shape[:2], m, (SIZE, SIZE), BORDER) for m in matrices]

    assert all(np.array_equal(a, b) for a, b in zip(kernel(), opencv(), strict=True)), \
        "the warp kernel's bytes differ from OpenCV's"
    return {"warp_ms": thread_ms(kernel, REPEATS), "warp_opencv_ms": thread_ms(opencv, REPEATS)}


def main() -> None:
    cv2.setNumThreads(1)  # one core, as in a loader worker
    rng = np.random.default_rng(0)
    np.random.seed(0)  # RandomHSV's draws
    figures = {**hsv(rng), **warp(rng)}
    for name in ("hsv", "warp"):
        print(f"{name}: {figures[f'{name}_ms']:.2f} ms an image, OpenCV "
              f"{figures[f'{name}_opencv_ms']:.2f} ms")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
