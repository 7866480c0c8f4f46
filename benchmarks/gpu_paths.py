"""What the CPU model of CUDA (``tests/cuda_model``) only stands in for, measured on a GPU.

    python benchmarks/gpu_paths.py --json gpu_paths.json [--parts memory,oom]
    python benchmarks/on_cuda_model.py benchmarks/gpu_paths.py --batch 16   # the plumbing

Each part runs in a fresh interpreter (a context, a kernel, a sized decoder or a cache that one
part made must not count in the next), and its result is written to ``--json`` as it ends, so
a run cut short keeps the parts that ran. Each result has a ``verdict``: ``ok``, ``failed: ...``
(the exit status is then 1), or ``n/a: ...`` where the part cannot apply here, with why.

- ``pinned``: the slots of a ``device="cuda"`` loader's slot pool are page-locked (CUDA's own
  answer, ``is_pinned``): else every copy from them is a synchronous pageable copy.
- ``memory``: an epoch of the GPU decode route through FastLoader (the copy and decode streams'
  caches included) over batches of ``--batch`` ImageNet-like crops (500x375 and the like, four
  5-megapixel photos): torch's peak reserved memory above what it held before the loader, after
  each batch (the peak so far, never reset), and the device memory outside torch's allocator
  (nvJPEG's own); which decoder ran.
- ``contexts``: the devices holding this process's CUDA context after an epoch of a loader on
  the last GPU (``cuda:N``, a script that never calls ``set_device``) with a transform on the
  device stage's helper thread: only N should. With one GPU it proves nothing: n/a.
- ``triton``: the first batch's wait of a loader with Ultralytics' GPU pixel ops in a fresh
  process with Triton's cache cold (a new ``TRITON_CACHE_DIR``), then in another with it warm:
  worker start-up is in both.
- ``oom``: the first GPU-decode batch through FastLoader's ``next()``, in a fresh process whose
  decoder is not sized yet, with all but ``--left-mib`` of the device's free memory taken: held
  by torch's cache (``cached``: decoded, after a release of torch's cache where nvJPEG's own
  allocation failed; the retries counted) or in use (``in use``: ``torch.OutOfMemoryError``),
  then ``close()``, which must return.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))

from on_cuda_model import python_command

PARTS = ("pinned", "memory", "contexts", "triton", "oom")
ONE = ("pinned", "memory", "contexts", "triton cold", "triton warm", "oom cached", "oom in use")


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


class Crops(torch.utils.data.Dataset):
    """ImageNet-like files, each with a RandomResizedCrop window to 224, as the GPU decode
    route's workers hand them over (``EncodedCrop``, a label)."""

    def __init__(self, count: int) -> None:
        self.files, self.sizes = imagenet_like(count)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        from fastfeed.vision.gpu_decode import EncodedCrop
        from fastfeed.vision.resample import crop_geometry

        rng = random.Random(index)
        w, h = self.sizes[index]
        while True:
            area = w * h * rng.uniform(0.08, 1.0)
            ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
            if 0 < cw <= w and 0 < ch <= h:
                break
        geometry = crop_geometry((rng.randint(0, w - cw), rng.randint(0, h - ch), cw, ch),
                                 (224, 224), flip=rng.random() < 0.5)
        return EncodedCrop.encoded(self.files[index], geometry, f"{index}.JPEG"), index


def decode_loader(args: argparse.Namespace, decode: Any, batches: int = 1) -> Any:
    from fastfeed import FastLoader
    from fastfeed.vision.gpu_decode import encoded_collate

    return FastLoader(Crops(args.batch * batches), batch_size=args.batch, num_workers=2,
                      device="cuda", collate_fn=encoded_collate, gpu_transform=decode)


def pinned(args: argparse.Namespace) -> dict[str, Any]:
    from torch.utils.data import TensorDataset

    from fastfeed import FastLoader

    data = TensorDataset(torch.randn(64, 3, 64, 64), torch.arange(64))
    loader = FastLoader(data, batch_size=8, num_workers=2, device="cuda")
    pageable = []
    checked = 0
    for _ in loader:
        for slot in loader._telemetry.slot_pool._slots.values():
            checked += 1
            if not torch.from_numpy(slot.memory).is_pinned():
                pageable.append(slot.slot_id)
    verdict = ("failed: the loader yielded nothing" if not checked else
               f"failed: pageable slots {sorted(set(pageable))}" if pageable else "ok")
    return {"verdict": verdict, "slot_readings": checked}


def memory(args: argparse.Namespace) -> dict[str, Any]:
    from fastfeed.vision import jpeg_decoders
    from fastfeed.vision.gpu_decode import DecodeCrops

    torch.zeros(1, device="cuda")  # the context, before the baseline
    torch.cuda.synchronize()
    base, free_before = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]
    torch.cuda.reset_peak_memory_stats()
    decode = DecodeCrops()
    rows = []
    start = time.perf_counter()
    for images, _ in decode_loader(args, decode, args.batches):
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        rows.append({"peak_reserved_gib": (torch.cuda.max_memory_reserved() - base) / 2**30,
                     "outside_torch_gib": (free_before - torch.cuda.mem_get_info()[0]
                                           - (reserved - base)) / 2**30,
                     "shape": list(images.shape)})
        del images
    return {"verdict": "ok" if len(rows) == args.batches else f"failed: {len(rows)} batches",
            "decoder": jpeg_decoders.describe(), "batch": args.batch,
            "seconds": time.perf_counter() - start,
            "peak_reserved_gib": max(r["peak_reserved_gib"] for r in rows),
            "outside_torch_gib": rows[-1]["outside_torch_gib"], "batches": rows}


class OnTheHelper:
    """A transform on the device stage's helper thread, as the GPU decode and pixel ops."""

    blocks_host = True

    def __call__(self, batch: Any) -> Any:
        return [batch[0] * 2, batch[1]]


def contexts(args: argparse.Namespace) -> dict[str, Any]:
    from torch.utils.data import TensorDataset

    from fastfeed import FastLoader
    from fastfeed._torch_compat import has_primary_context

    count = torch.cuda.device_count()
    if count < 2:
        return {"verdict": "n/a: one GPU (a context on a GPU the loader does not use needs a "
                           "second one to show)"}
    last = count - 1
    data = TensorDataset(torch.randn(64, 3, 32, 32), torch.arange(64))
    loader = FastLoader(data, batch_size=8, num_workers=2, device=f"cuda:{last}",
                        gpu_transform=OnTheHelper())
    for images, _ in loader:
        images.sum()
    with torch.cuda.device(last):
        torch.cuda.synchronize()
    held = [index for index in range(count) if has_primary_context(index)]
    return {"verdict": "ok" if held == [last] else f"failed: contexts on {held}",
            "loader_device": last, "contexts": held}


def triton(args: argparse.Namespace) -> dict[str, Any]:
    from test_pixel_ops_launches import RecordedSamples, listed  # the tests' recorded samples

    from fastfeed import FastLoader
    from fastfeed.ultralytics.gpu_augment import CanvasCollate, PixelOps

    loader = FastLoader(RecordedSamples(), batch_size=4, num_workers=2, device="cuda",
                        collate_fn=CanvasCollate(listed), gpu_transform=PixelOps(truncate_hsv=True))
    start = time.perf_counter()
    batches = iter(loader)
    next(batches)
    torch.cuda.synchronize()
    return {"first_batch_s": time.perf_counter() - start}


def oom(args: argparse.Namespace, case: str) -> dict[str, Any]:
    from fastfeed.vision.gpu_decode import DecodeCrops

    torch.zeros(1, device="cuda")
    hog = torch.empty(max(0, torch.cuda.mem_get_info()[0] - (args.left_mib << 20)),
                      dtype=torch.uint8, device="cuda")
    if case == "cached":
        del hog  # torch's cache keeps it: nvJPEG's cudaMalloc finds nothing free
    result: dict[str, Any] = {"free_mib": torch.cuda.mem_get_info()[0] / 2**20}
    decode = DecodeCrops()
    batches = iter(decode_loader(args, decode))
    try:
        next(batches)
        torch.cuda.synchronize()
        result["outcome"] = "decoded"
    except torch.OutOfMemoryError as error:
        result["outcome"] = f"out of memory: {str(error)[:300]}"
    except Exception as error:
        result["outcome"] = f"{type(error).__name__}: {str(error)[:300]}"
    result["retries"] = decode.memory_retries
    start = time.perf_counter()
    batches.close()
    result["close_s"] = time.perf_counter() - start
    want = "decoded" if case == "cached" else "out of memory"
    result["verdict"] = "ok" if result["outcome"].startswith(want) else f"failed: not {want}"
    return result


def one(args: argparse.Namespace, part: str) -> dict[str, Any]:
    """A part (or one case of it) here, in this interpreter."""
    if part in ("triton cold", "triton warm"):
        try:
            import triton as _  # noqa: F401
        except ImportError:
            return {"verdict": "n/a: Triton is not installed"}
        return triton(args)
    if part.startswith("oom "):
        return oom(args, part[4:])
    return {"pinned": pinned, "memory": memory, "contexts": contexts}[part](args)


def fresh(args: argparse.Namespace, part: str, env: dict[str, str] | None = None
          ) -> dict[str, Any]:
    """``part`` in a fresh interpreter: its result, or why there is none."""
    command = [*python_command(), __file__, "--one", part, "--batch", str(args.batch),
               "--batches", str(args.batches), "--left-mib", str(args.left_mib)]
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    environment = {**os.environ, **(env or {}),
                   "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get(
                       "PYTHONPATH")]))}
    try:
        run = subprocess.run(command, capture_output=True, text=True, env=environment,
                             check=False, timeout=args.part_timeout)
    except subprocess.TimeoutExpired:
        return {"verdict": f"failed: no result in {args.part_timeout} s"}
    if run.returncode != 0:
        sys.stderr.write(run.stderr)
        last = (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1]
        return {"verdict": f"failed: {last}"}
    return json.loads(run.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace, part: str) -> dict[str, Any]:
    if part == "triton":
        with tempfile.TemporaryDirectory() as cache:
            cold = fresh(args, "triton cold", {"TRITON_CACHE_DIR": cache})
            if "verdict" in cold:
                return cold
            warm = fresh(args, "triton warm", {"TRITON_CACHE_DIR": cache})
        if "verdict" in warm:
            return warm
        return {"verdict": "ok", "first_batch_cold_s": cold["first_batch_s"],
                "first_batch_warm_s": warm["first_batch_s"]}
    if part == "oom":
        cases = {case: fresh(args, f"oom {case}") for case in ("cached", "in use")}
        failed = [f"{case}: {r['verdict']}" for case, r in cases.items() if r["verdict"] != "ok"]
        return {"verdict": f"failed: {'; '.join(failed)}" if failed else "ok", **cases}
    return fresh(args, part)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    parser.add_argument("--batch", type=int, default=256, help="crops a batch (memory, oom)")
    parser.add_argument("--batches", type=int, default=3, help="batches of the memory part")
    parser.add_argument("--left-mib", type=int, default=48, help="free memory left (oom)")
    parser.add_argument("--part-timeout", type=int, default=120, help="seconds per interpreter")
    parser.add_argument("--json", type=Path, help="the results, rewritten as each part ends")
    parser.add_argument("--one", choices=ONE, help=argparse.SUPPRESS)  # a fresh interpreter's
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args, args.one)))
        return
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}: of {', '.join(PARTS)}")
    results: dict[str, Any] = {"parts": {}}
    for part in parts:
        start = time.perf_counter()
        results["parts"][part] = {**measure(args, part),
                                  "part_seconds": round(time.perf_counter() - start, 1)}
        print(f"{part}: {json.dumps(results['parts'][part])}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    failed = [p for p, r in results["parts"].items() if r["verdict"].startswith("failed")]
    sys.exit(f"failed: {', '.join(failed)}" if failed else 0)


if __name__ == "__main__":
    main()
