"""The cost per batch of ``augment_device``'s pixel ops alone (``ultralytics_pipeline.py
--ops-device``).

A batch of mosaic canvases (2·imgsz square, noise) with Ultralytics-like matrices, HSV applied
and the channels reversed, packed as the workers pack them. Each route of ``PixelOps`` runs on
the batch already on the device: the torch ops, and on CUDA where Triton imports the fused
kernel; the routes alternate, and each figure is a median:

- **ms per batch**: from a synchronised start to a synchronised end;
- **host ms** (CUDA): until the call returns, the time the loader's helper thread spends
  queueing it;
- **torch ops** dispatched in one call (launches and views; off the CPU the torch ops' float32
  multiply-add is two dozen of them: ``--ops-device meta`` counts those on any machine), and
  on CUDA the **kernels** a profiler sees;
- on CUDA, the host-to-device copy of the packed parts, on its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastfeed.ultralytics.gpu_augment import (
    HSV_FLAG,
    LUT_KEY,
    PARAM_COLUMNS,
    PARAMS_KEY,
    REGION_KEY,
    REVERSE_FLAG,
    SIZE_KEY,
    PixelOps,
)
from fastfeed.ultralytics.pixel_ops import source_region


def recorded_batch(imgsz: int, batch_size: int) -> dict[str, Any]:
    """The batch a collate packs for ``augment_device``, on the host."""
    g = torch.Generator().manual_seed(0)
    canvas = torch.randint(0, 256, (2 * imgsz, 2 * imgsz, 3), dtype=torch.uint8, generator=g)
    angle = (torch.rand(batch_size, generator=g) - 0.5) * 0.2
    scale = 0.5 + torch.rand(batch_size, generator=g)
    params = torch.zeros(batch_size, PARAM_COLUMNS, dtype=torch.float64)
    params[:, 0], params[:, 1] = scale * angle.cos(), -scale * angle.sin()
    params[:, 3], params[:, 4] = scale * angle.sin(), scale * angle.cos()
    params[:, 2] = params[:, 5] = -imgsz * scale + imgsz / 2  # the canvas centre to the output's
    params[:, HSV_FLAG] = params[:, REVERSE_FLAG] = 1
    luts = torch.randint(0, 256, (batch_size, 3, 256), dtype=torch.uint8, generator=g)
    luts[:, 0] %= 180
    parts, regions, first = [], [], 0
    for matrix in params[:, :6].view(-1, 2, 3).numpy():
        left, top, right, bottom = source_region(np.vstack([matrix, [0, 0, 1]]), (imgsz, imgsz),
                                                 2 * imgsz, 2 * imgsz)
        parts.append(canvas[top:bottom, left:right].reshape(-1, 3))
        regions.append([first, bottom - top, right - left, left, top])
        first += len(parts[-1])
    return {"img": torch.cat(parts), PARAMS_KEY: params, LUT_KEY: luts,
            REGION_KEY: torch.tensor(regions), SIZE_KEY: (imgsz, imgsz)}


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _cuda_kernels(call: Callable[[], Any]) -> str:
    """Kernels (not copies) in a profiler trace of ``call``."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            call()
            torch.cuda.synchronize()
        kernels = [e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset"))]
        return f", {len(kernels)} CUDA kernels"
    except Exception as error:  # a profiler that cannot trace here costs the figure only
        return f", CUDA kernels not counted ({type(error).__name__}: {error})"


def device_ops_ms(device: str, imgsz: int, batch_size: int, repeats: int = 20) -> str:
    """The report of the module's notes, one line per route."""
    host = recorded_batch(imgsz, batch_size)
    cuda = device.startswith("cuda")
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in host.items()}
    routes = {"torch ops": PixelOps(truncate_hsv=True, fused=False)}  # no OpenCV needed
    if cuda:
        try:
            import triton  # noqa: F401
            routes["fused kernel"] = PixelOps(truncate_hsv=True, fused=True)
        except ImportError:
            pass

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for ops in routes.values():  # tables made, kernel compiled
        ops(dict(on_device))
    sync()
    device_ms: dict[str, list[float]] = {name: [] for name in routes}
    host_ms: dict[str, list[float]] = {name: [] for name in routes}
    for _ in range(repeats):
        for name, ops in routes.items():
            sync()
            start = time.perf_counter()
            ops(dict(on_device))
            queued = time.perf_counter()
            sync()
            host_ms[name].append((queued - start) * 1e3)
            device_ms[name].append((time.perf_counter() - start) * 1e3)
    canvas_pixels = (2 * imgsz) ** 2 * batch_size
    name = torch.cuda.get_device_name() if cuda else f"{device} (one process)"
    lines = [f"pixel ops on {name}: batch {batch_size} of {2 * imgsz}² canvases -> {imgsz}² "
             f"({len(host['img']) / canvas_pixels:.0%} of each canvas read), median of "
             f"{repeats}, routes alternating:"]
    for route, ops in routes.items():
        with _Ops() as dispatched:
            ops(dict(on_device))
        kernels = _cuda_kernels(lambda ops=ops: ops(dict(on_device))) if cuda else ""
        queue = f"{np.median(host_ms[route]):.2f} host ms to queue, " if cuda else ""
        lines.append(f"  {route}: {np.median(device_ms[route]):.2f} ms per batch, {queue}"
                     f"{dispatched.count} torch ops{kernels}")
    if cuda:
        pinned = host["img"].pin_memory()
        copy = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            pinned.to(device, non_blocking=True)
            sync()
            copy.append((time.perf_counter() - start) * 1e3)
        lines.append(f"  host-to-device copy of the parts: {np.median(copy):.2f} ms per batch")
    return "\n".join(lines)
