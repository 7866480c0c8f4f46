"""What the CPU model of CUDA (``tests/cuda_model``) only stands in for, measured on a GPU.

    python benchmarks/gpu_paths.py --device cuda --json gpu_paths.json
    python benchmarks/gpu_paths.py --device cpu    # the plumbing: the same code, no CUDA figures

- ``memory``: the GPU decode route (decode and resize) over batches of ``--batch`` ImageNet-like
  crops (500x375 and the like, four 5-megapixel photos): torch's peak reserved memory above the
  start per batch, and the device memory outside torch's allocator (nvJPEG's own).
- ``contexts``: the devices holding this process's CUDA context after an epoch of a loader on
  the last GPU (``cuda:N``, a script that never calls ``set_device``) with a transform on the
  device stage's helper thread: only N should (with one GPU: the index the loader was given).
- ``triton``: the first batch's wait of a loader with Ultralytics' GPU pixel ops, Triton's cache
  cold (a new ``TRITON_CACHE_DIR``), against the next epoch's.
- ``oom``: the GPU decode with torch's cache holding almost all free memory (decoded after the
  flush, or not), and under a memory fraction too small for the batch (the error raised).

``contexts`` and ``triton`` run in a fresh interpreter each: a context, or a kernel, this
process made first would count.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from io import BytesIO
from typing import Any

import numpy as np
import torch
from PIL import Image

PARTS = ("memory", "contexts", "triton", "oom")


def imagenet_like(count: int, seed: int = 0) -> tuple[list[bytes], list[tuple[int, int]]]:
    rng = random.Random(seed)
    files, sizes = [], []
    for i in range(count):
        size = ((2592, 1944) if i % 2 else (1944, 2592)) if i < 4 else rng.choice(
            [(500, 375), (375, 500), (500, 333), (rng.randint(200, 500), rng.randint(150, 500))])
        pixels = np.random.default_rng(i).integers(0, 256, (size[1] // 8, size[0] // 8, 3),
                                                   np.uint8)
        file = BytesIO()
        Image.fromarray(pixels).resize(size).save(file, "JPEG", quality=85)
        files.append(file.getvalue())
        sizes.append(size)
    return files, sizes


def crops_batch(files: list[bytes], sizes: list[tuple[int, int]], rng: random.Random
                ) -> dict[str, Any]:
    """The files with RandomResizedCrop windows to 224, collated as the workers do."""
    from fastfeed.vision.gpu_decode import EncodedCrop, collate_crops
    from fastfeed.vision.resample import crop_geometry

    crops = []
    for data, (w, h) in zip(files, sizes, strict=True):
        while True:
            area = w * h * rng.uniform(0.08, 1.0)
            ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
            if 0 < cw <= w and 0 < ch <= h:
                break
        geometry = crop_geometry((rng.randint(0, w - cw), rng.randint(0, h - ch), cw, ch),
                                 (224, 224), flip=rng.random() < 0.5)
        crops.append(EncodedCrop.encoded(data, geometry, "synthetic.JPEG"))
    return collate_crops(crops)


def pillow_decode(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The plumbing's decoder (no GPU decoder is needed on the CPU)."""
    return [torch.from_numpy(np.array(Image.open(BytesIO(f.numpy().tobytes())).convert("RGB"))
                             ).permute(2, 0, 1).contiguous() for f in files]


def decode_batches(device: torch.device, count: int, batches: int) -> list[dict[str, Any]]:
    from fastfeed.vision.gpu_decode import DecodeCrops

    files, sizes = imagenet_like(count)
    rng = random.Random(1)
    decode = DecodeCrops(decoder=None if device.type == "cuda" else pillow_decode)
    rows = []
    for index in range(batches):
        crops = crops_batch(files, sizes, rng)
        crops["pixels"] = torch.empty((0, 3, 224, 224), dtype=torch.uint8, device=device)
        row: dict[str, Any] = {"batch": index}
        start = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_reserved()
            free_before = torch.cuda.mem_get_info()[0]
            torch.cuda.reset_peak_memory_stats()
            images = decode.images(crops)
            torch.cuda.synchronize()
            row["peak_reserved_gib"] = (torch.cuda.max_memory_reserved() - base) / 2**30
            outside = free_before - torch.cuda.mem_get_info()[0] - (
                torch.cuda.memory_reserved() - base)
            row["outside_torch_gib"] = outside / 2**30  # nvJPEG's, kept by its decoder
        else:
            images = decode.images(crops)
        row["seconds"] = time.perf_counter() - start
        row["shape"] = list(images.shape)
        rows.append(row)
        del images
    return rows


def active_contexts() -> list[int]:
    """The devices whose primary context this process holds (the driver's own answer)."""
    from fastfeed.device.own_streams import libcuda

    lib = libcuda()
    lib.cuInit(0)
    count = ctypes.c_int()
    lib.cuDeviceGetCount(ctypes.byref(count))
    active = []
    for index in range(count.value):
        device, flags, state = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        lib.cuDeviceGet(ctypes.byref(device), index)
        lib.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(state))
        if state.value:
            active.append(index)
    return active


class OnTheHelper:
    """A transform on the device stage's helper thread, as the GPU decode and pixel ops."""

    blocks_host = True

    def __call__(self, batch: Any) -> Any:
        return [batch[0] * 2, batch[1]]


def contexts() -> dict[str, Any]:
    from torch.utils.data import TensorDataset

    from fastfeed import FastLoader

    last = torch.cuda.device_count() - 1
    data = TensorDataset(torch.randn(64, 3, 32, 32), torch.arange(64))
    loader = FastLoader(data, batch_size=8, num_workers=2, device=f"cuda:{last}",
                        gpu_transform=OnTheHelper())
    for images, _ in loader:
        images.sum()
    torch.cuda.synchronize(last)
    return {"loader_device": last, "contexts": active_contexts(),
            "ok": active_contexts() == [last]}


def recorded_samples(count: int, size: int = 640) -> Any:
    from fastfeed.ultralytics.gpu_augment import (
        HSV_FLAG,
        LUT_KEY,
        PARAM_COLUMNS,
        PARAMS_KEY,
        REGION_KEY,
        SIZE_KEY,
    )
    from fastfeed.ultralytics.pixel_ops import source_region

    class Recorded(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return count

        def __getitem__(self, index: int) -> dict[str, Any]:
            canvas = torch.randint(0, 256, (2 * size, 2 * size, 3), dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(index))
            matrix = np.diag([0.5, 0.5, 1.0])
            left, top, right, bottom = source_region(matrix, (size, size), 2 * size, 2 * size)
            params = torch.zeros(PARAM_COLUMNS, dtype=torch.float64)
            params[:6] = torch.from_numpy(matrix[:2].ravel())
            params[HSV_FLAG] = 1
            lut = (torch.arange(256) % 180).to(torch.uint8).expand(3, 256).contiguous()
            return {"img": canvas[top:bottom, left:right], PARAMS_KEY: params, LUT_KEY: lut,
                    REGION_KEY: torch.tensor([bottom - top, right - left, left, top]),
                    SIZE_KEY: (size, size)}

    return Recorded()


def listed(samples: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {key: [sample[key] for sample in samples] for key in samples[0]}


def triton() -> dict[str, Any]:
    from fastfeed import FastLoader
    from fastfeed.ultralytics.gpu_augment import CanvasCollate, PixelOps

    loader = FastLoader(recorded_samples(64), batch_size=16, num_workers=4, device="cuda",
                        collate_fn=CanvasCollate(listed), persistent_workers=True,
                        gpu_transform=PixelOps(truncate_hsv=True))
    waits = []
    for _ in range(2):
        start = time.perf_counter()
        batches = iter(loader)
        next(batches)
        torch.cuda.synchronize()
        waits.append(time.perf_counter() - start)
        for _ in batches:
            pass
    return {"first_batch_cold_s": waits[0], "first_batch_warm_s": waits[1],
            "triton_cache": os.environ.get("TRITON_CACHE_DIR")}


def oom(count: int) -> dict[str, Any]:
    from fastfeed.vision.gpu_decode import DecodeCrops

    files, sizes = imagenet_like(count)
    rng = random.Random(2)
    result: dict[str, Any] = {}
    for case in ("cache holds the memory", "memory fraction"):
        crops = crops_batch(files, sizes, rng)
        crops["pixels"] = torch.empty((0, 3, 224, 224), dtype=torch.uint8, device="cuda")
        if case == "cache holds the memory":
            hog = torch.empty(int(torch.cuda.mem_get_info()[0] * 0.97), dtype=torch.uint8,
                              device="cuda")
            del hog  # torch's cache keeps it: nvJPEG's cudaMalloc finds nothing free
        else:
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction((64 << 20) / total)
        try:
            DecodeCrops().images(crops)
            torch.cuda.synchronize()
            result[case] = "decoded"
        except Exception as error:
            result[case] = f"{type(error).__name__}: {str(error)[:160]}"
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
    return result


def in_fresh_interpreter(part: str, env: dict[str, str]) -> Any:
    run = subprocess.run([sys.executable, __file__, "--device", "cuda", "--part", part],
                         capture_output=True, text=True, env={**os.environ, **env}, check=False,
                         timeout=300)
    if run.returncode != 0:
        return {"error": run.stderr.strip().splitlines()[-1:] or [f"exit {run.returncode}"]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--batch", type=int, default=256, help="crops a batch (memory, oom)")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--part", choices=PARTS, help="run one part here, print its JSON")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.part:  # a fresh interpreter's part
        print(json.dumps({"contexts": contexts, "triton": triton}[args.part]()))
        return
    results: dict[str, Any] = {"device": str(device), "memory": decode_batches(
        device, args.batch, args.batches)}
    if device.type == "cuda":
        results["contexts"] = in_fresh_interpreter("contexts", {})
        with tempfile.TemporaryDirectory() as cold:
            results["triton"] = in_fresh_interpreter("triton", {"TRITON_CACHE_DIR": cold})
        results["oom"] = oom(args.batch)
    else:
        for part in ("contexts", "triton", "oom"):
            results[part] = "needs CUDA: not measured"
    for part, value in results.items():
        print(f"{part}: {json.dumps(value)}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
