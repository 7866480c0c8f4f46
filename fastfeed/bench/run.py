"""One measurement of one configuration, in a process of its own (clean peak RSS)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from fastfeed import transforms as T
from fastfeed.bench.data import Source, baseline, resolve
from fastfeed.loader import FastLoader
from fastfeed.tree import map_tensors

__all__ = ["Job", "measure", "run_in_child"]


@dataclass(frozen=True)
class Job:
    data: str
    images: int
    config: str  # "stock", "fastfeed", "fastfeed+device", "dali", or TORCHVISION_CONFIGS
    workers: str  # an int as text, or "auto"
    batch_size: int
    batches: int
    device: str | None
    step_ms: float
    model: str | None


def _build(job: Job, source: Source) -> Any:
    if job.config == "dali":
        threads = max(1, int(job.workers)) if job.workers.isdigit() else 2
        assert source.root is not None
        if job.device and torch.device(job.device).type == "cuda":
            from fastfeed.vision.dali import DaliLoader

            return DaliLoader(source.root, job.batch_size, device=job.device, num_threads=threads)
        from fastfeed.bench.peers import build_peer

        return build_peer("dali-cpu", source.root, job.batch_size, threads)
    dataset, collate = source.dataset(job.config)
    workers: int | str = job.workers if job.workers == "auto" else int(job.workers)
    kwargs: dict[str, Any] = {"batch_size": job.batch_size, "shuffle": True,
                              "collate_fn": collate}
    if job.config == baseline(job.config):
        stock_workers = workers if isinstance(workers, int) else 2
        return DataLoader(dataset, num_workers=stock_workers,
                          pin_memory=job.device == "cuda", **kwargs)
    if job.config == "fastfeed+device":
        key = "img" if source.kind == "detect" else 0
        kwargs.update(device=job.device, gpu_transform=T.Normalize(key=key))
    return FastLoader(dataset, num_workers=workers, **kwargs)


def _images(batch: Any) -> torch.Tensor:
    if isinstance(batch, dict):
        return batch["img"]
    if isinstance(batch, (list, tuple)):
        return batch[0]
    return batch


def measure(job: Job) -> dict[str, float]:
    """Iterate ``job.batches`` batches with a simulated (or real) step; return the figures."""
    source = resolve(job.data, job.images)
    device = torch.device(job.device) if job.device else None
    model = None
    if job.model:
        from fastfeed.bench.models import TrainStep

        model = TrainStep(job.model, device or torch.device("cpu"))
    start = time.perf_counter()  # building counts: DALI builds its pipeline up front
    loader = _build(job, source)
    normalize = T.Normalize(key="img" if source.kind == "detect" else 0)
    iterator = iter(loader)
    waited, samples, first = 0.0, 0, None
    for _ in range(job.batches):
        before = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            iterator = iter(loader)
            batch = next(iterator)
        if device is not None and job.config == baseline(job.config):
            batch = normalize(map_tensors(lambda t: t.to(device, non_blocking=True), batch))
        waited += time.perf_counter() - before
        if first is None:
            first = time.perf_counter() - start
        images = _images(batch)
        samples += len(images)
        if model is not None:
            model.step(images)
        elif job.step_ms:
            time.sleep(job.step_ms / 1000)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
    del iterator
    return {"samples_per_s": samples / elapsed, "stall_pct": 100 * waited / elapsed,
            "first_batch_s": first or 0.0, "peak_rss_mb": peak}


def run_in_child(job: Job) -> dict[str, float]:
    """Run :func:`measure` in a fresh interpreter and return its figures."""
    out = subprocess.run([sys.executable, "-m", "fastfeed.bench.run", json.dumps(asdict(job))],
                         capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{job.config} with {job.workers} workers failed: {last}")
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(measure(Job(**json.loads(sys.argv[1])))))
