"""Where ``augment_device``'s pixel ops are queued and how many launches they take, without a
GPU: the torch ops traced on the meta device (a device that is not the CPU, as a GPU), and the
whole loader on the CPU model of CUDA (``cuda_model``). The fused kernel's launch count is in
``test_pixel_kernel.py``."""

import sys
import threading
import types

import cuda_model
import numpy as np
import pytest
import torch
from pixel_batches import params, recorded
from test_pixel_ops import random_images, random_matrices
from torch.utils._python_dispatch import TorchDispatchMode

from fastfeed import FastLoader
from fastfeed.ultralytics import pixel_ops
from fastfeed.ultralytics.gpu_augment import CanvasCollate, PixelOps
from fastfeed.ultralytics.pixel_ops import source_region

CANVAS, SIZE = 64, (32, 24)


class RecordedSamples(torch.utils.data.Dataset):
    """Samples as ``augment_device``'s workers leave them: the part of a noise canvas that its
    warp reads, the warp's matrix, an HSV table, and flags that differ from sample to sample.
    ``size``: the warp's output (width, height); an attribute, so that workers started by
    pickling the dataset (forkserver, spawn) get it too."""

    def __init__(self, size=SIZE):
        self.size = size

    def __len__(self):
        return 10

    def __getitem__(self, index):
        canvas = random_images(1, CANVAS, CANVAS, seed=index)[0]
        matrix = random_matrices(1, CANVAS, self.size[0], seed=index)[0]
        left, top, right, bottom = source_region(matrix, self.size, CANVAS, CANVAS)
        lut = torch.from_numpy(np.random.default_rng(index).integers(0, 180, (3, 256), np.uint8))
        return recorded(canvas[top:bottom, left:right], params([matrix], [index])[0], lut,
                        torch.tensor([bottom - top, right - left, left, top]), self.size)


def listed(samples):
    """The collate the parameters need before CanvasCollate stacks them: one list a key."""
    return {key: [sample[key] for sample in samples] for key in samples[0]}


class Ops(TorchDispatchMode):
    """Counts the torch ops dispatched in its scope."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_torch_ops_take_as_many_launches_for_any_batch_size():
    ops, counts = PixelOps(truncate_hsv=True, fused=False), []
    for size in (2, 8):
        batch = CanvasCollate(listed)([RecordedSamples()[i] for i in range(size)])
        on_meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v
                   for k, v in batch.items()}
        ops(dict(on_meta))  # the first call makes the per-device tables
        with Ops() as traced:
            out = ops(on_meta)
        assert out["img"].shape == (size, 3, SIZE[1], SIZE[0])
        counts.append(traced.count)
    assert counts[0] == counts[1], counts


@pytest.fixture
def gpu(monkeypatch):
    yield cuda_model.install(monkeypatch, cuda_model.Gpu())
    pixel_ops._sectors.cache_clear()  # the tables made on this test's device
    pixel_ops._division_table.cache_clear()


def test_the_loader_queues_the_pixel_ops_off_the_training_thread(gpu, monkeypatch):
    """As FastLoader runs nvjpeg's decode: the copy and the ops in its helper thread, on the
    copy stream, with no host sync; the training thread queues nothing. (The torch ops: the
    fused kernel needs a real GPU, and is one launch in the same call.)"""
    queued = []
    launch = gpu.launch

    def recorded(stream, name, run):
        queued.append((threading.current_thread().name, stream.name))
        launch(stream, name, run)

    monkeypatch.setattr(gpu, "launch", recorded)
    dataset, collate = RecordedSamples(), CanvasCollate(listed)
    loader = FastLoader(dataset, batch_size=4, num_workers=2, device="cuda", collate_fn=collate,
                        gpu_transform=PixelOps(truncate_hsv=True, fused=False))
    got = list(loader)
    assert queued and not [q for q in queued if q[0] == "MainThread"]
    streams = {stream for _, stream in queued}
    assert len(streams) == 1 and streams != {"default"}  # the loader's copy stream
    assert gpu.syncs_in("MainThread") == []
    gpu.run()
    reference = PixelOps(truncate_hsv=True, fused=False)
    for start, batch in zip(range(0, len(dataset), 4), got, strict=True):
        samples = [dataset[i] for i in range(start, min(start + 4, len(dataset)))]
        want = reference(collate(samples))["img"]
        assert torch.equal(gpu.read(batch["img"]), want), f"batch at {start}"


def test_where_the_kernel_is_missing_or_fails_to_build_the_torch_ops_run(gpu, monkeypatch):
    batch = CanvasCollate(listed)([RecordedSamples()[i] for i in range(3)])
    want = PixelOps(truncate_hsv=True, fused=False)(dict(batch))["img"]
    on_device = {k: v.pin_memory().to("cuda", non_blocking=True) if isinstance(v, torch.Tensor)
                 else v for k, v in batch.items()}

    def run(ops):
        out = ops(dict(on_device))["img"]
        gpu.run()
        return gpu.read(out)

    monkeypatch.setitem(sys.modules, "fastfeed.ultralytics.pixel_kernel", None)  # no Triton
    ops = PixelOps(truncate_hsv=True)
    assert torch.equal(run(ops), want) and ops.fused is False
    with pytest.raises(ImportError):
        PixelOps(truncate_hsv=True, fused=True)(dict(on_device))

    attempts = []

    def fails_to_build(*args):
        attempts.append(args)
        raise RuntimeError("Failed to find C compiler")

    kernel = types.ModuleType("fastfeed.ultralytics.pixel_kernel")
    kernel.apply_pixel_ops = fails_to_build
    monkeypatch.setitem(sys.modules, "fastfeed.ultralytics.pixel_kernel", kernel)
    ops = PixelOps(truncate_hsv=True)
    with pytest.warns(RuntimeWarning, match="C compiler.*using torch ops"):
        assert torch.equal(run(ops), want)
    assert torch.equal(run(ops), want) and len(attempts) == 1  # tried once
    with pytest.raises(RuntimeError, match="C compiler"):
        PixelOps(truncate_hsv=True, fused=True)(dict(on_device))
