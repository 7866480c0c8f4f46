"""The fused Triton kernel of ``augment_device`` (``fastfeed.ultralytics.pixel_kernel``) without a
GPU: run by Triton's interpreter on CPU tensors against the torch ops (the reference) and against
OpenCV, its launches counted, and compiled for an H100 to count the multiply-adds it fuses. On a
GPU (``gpu`` tests): the kernel there against the CPU, and no host sync."""

import importlib
import os
import re

import numpy as np
import pytest
import torch
from helpers import host_syncs_raise
from pixel_batches import FLAG_COLUMNS, params, recorded
from test_pixel_ops import pack, random_images, random_matrices
from test_pixel_ops_launches import Ops
from torch.utils._python_dispatch import _disable_current_modes

from fastfeed.ultralytics.gpu_augment import LUT_KEY, PARAMS_KEY, REGION_KEY, PixelOps

pytestmark = pytest.mark.clients
triton = pytest.importorskip("triton")


@pytest.fixture
def interpreted():
    """``pixel_kernel`` with its kernel run by Triton's interpreter (which reads
    ``TRITON_INTERPRET`` when a kernel is defined); defined again as it was afterwards."""
    from fastfeed.ultralytics import pixel_kernel

    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.reload(pixel_kernel)
        # The interpreter takes some 0.2 s a program, whatever its size: few, large blocks.
        pixel_kernel.BLOCK = 4096
        yield pixel_kernel
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
        importlib.reload(pixel_kernel)


def recorded_batch(images, matrices, size, seed=0):
    """A collated batch as the workers record it: the parts the warps read, the matrices,
    random HSV tables and every combination of the flags over the images."""
    batch = len(images)
    pixels, regions = pack(images, matrices, size)
    g = torch.Generator().manual_seed(seed)
    luts = torch.randint(0, 256, (batch, 3, 256), dtype=torch.uint8, generator=g)
    luts[:, 0] %= 180  # hues, as RandomHSV's table holds them
    return recorded(pixels, params(matrices, range(batch)), luts, regions, size)


def awkward_matrices(batch, canvas, size, seed):
    """random_matrices with a quarter turn (coefficients of 1e-8 beside ones), a map that
    lands off the canvas, and a singular one."""
    matrices = random_matrices(batch, canvas, size, seed=seed)
    matrices[1] = [[np.cos(np.pi / 2), -1.0, 150.0], [1.0, np.cos(np.pi / 2), -20.0], [0, 0, 1]]
    matrices[2] = [[1.0, 0, -5000], [0, 1, 40], [0, 0, 1]]
    matrices[3] = [[0.0, 0, 3], [0, 0, 4], [0, 0, 1]]
    return matrices


@pytest.mark.parametrize("truncate", [True, False], ids=["opencv5", "opencv4"])
def test_the_kernel_makes_the_torch_ops_bytes(interpreted, truncate):
    # 96×50: an output of one full block and a part of one, in every image
    images = random_images(16, 150, 170, seed=7)
    batch = recorded_batch(images, awkward_matrices(16, 160, 96, seed=8), (96, 50))
    want = PixelOps(truncate, fused=False)(dict(batch))["img"]
    got = PixelOps(truncate, fused=True)(dict(batch))["img"]
    assert got.shape == want.shape == (16, 3, 50, 96) and got.is_contiguous()
    assert torch.equal(got, want), (got != want).sum()


def test_the_kernel_makes_opencvs_bytes(interpreted):
    """Stock's pixel work, sample by sample: cv2.warpAffine, RandomHSV's cvtColor, LUT and
    cvtColor back, the flips, then Format's channel order and layout. (Rows of a multiple of
    32 pixels, as Ultralytics' are: OpenCV 5's HSV→BGR rounds the last ``width % 32`` pixels of
    a row, where its vector loop truncates.)"""
    cv2 = pytest.importorskip("cv2")
    from fastfeed.ultralytics.gpu_augment import opencv_hsv_truncates

    images = random_images(8, 128, 128, seed=9)
    matrices = random_matrices(8, 128, 96, seed=10)
    batch = recorded_batch(images, matrices, (96, 64), seed=11)
    expected = []
    for image, matrix, luts, flags in zip(images.numpy(), matrices, batch[LUT_KEY].numpy(),
                                          batch[PARAMS_KEY][:, 6:].bool().tolist(), strict=True):
        hsv, reverse, mirror, upside_down = flags
        out = cv2.warpAffine(image, matrix[:2], dsize=(96, 64), borderValue=(114, 114, 114))
        if hsv:
            h, s, v = cv2.split(cv2.cvtColor(out, cv2.COLOR_BGR2HSV))
            merged = cv2.merge((cv2.LUT(h, luts[0]), cv2.LUT(s, luts[1]), cv2.LUT(v, luts[2])))
            out = cv2.cvtColor(merged, cv2.COLOR_HSV2BGR)
        out = np.fliplr(out) if mirror else out
        out = np.flipud(out) if upside_down else out
        expected.append((out[..., ::-1] if reverse else out).transpose(2, 0, 1))
    got = PixelOps(opencv_hsv_truncates(), fused=True)(batch)["img"]
    assert np.array_equal(got.numpy(), np.stack(expected)), (got.numpy() != expected).mean()


def test_one_launch_a_batch_whatever_its_size(interpreted, monkeypatch):
    kernel = interpreted._pixel_ops_kernel
    launches = []

    class Counted:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(grid)
                with _disable_current_modes():  # the interpreter's own copies are not ours
                    return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(interpreted, "_pixel_ops_kernel", Counted())
    ops = PixelOps(truncate_hsv=True, fused=True)
    counts = []
    for size in (2, 8):
        batch = recorded_batch(random_images(size, 64, 64), random_matrices(size, 64, 32),
                               (32, 32))
        launches.clear()
        with Ops() as torch_ops:
            ops(batch)
        counts.append((len(launches), torch_ops.count))
    assert counts == [(1, 1), (1, 1)]  # the kernel, and the output's torch.empty


def test_the_kernel_refuses_what_it_would_misread():
    from fastfeed.ultralytics.pixel_kernel import apply_pixel_ops

    batch = recorded_batch(random_images(2, 32, 32), random_matrices(2, 32, 16), (16, 16))
    args = [batch[k] for k in ("img", REGION_KEY, PARAMS_KEY, LUT_KEY)]
    for index, wrong in ((0, args[0].view(-1)), (1, args[1].int()), (2, args[2].float()),
                         (3, args[3][:1])):
        bad = list(args)
        bad[index] = wrong
        with pytest.raises(ValueError, match="must be"):
            apply_pixel_ops(*bad, (16, 16), 114, True, FLAG_COLUMNS)


def test_compiled_for_an_h100_it_fuses_opencvs_multiply_adds_and_no_other():
    """Triton contracts a multiply and an add into one fused multiply-add unless told not to,
    and OpenCV fuses some of its steps and not others: built for sm_90 as the launch builds it,
    the kernel has one fma per multiply-add OpenCV fuses (2 for the source coordinates, 3 per
    channel for the interpolation, 2 in HSV→BGR) and no float64 one (the inverse map)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fastfeed.ultralytics import pixel_kernel

    signature = {"pixels": "*u8", "regions": "*i64", "params": "*fp64", "luts": "*u8",
                 "out": "*u8", "out_h": "i32", "out_w": "i32", "params_stride": "i32",
                 "border": "fp32"}
    names = ("HSV_COLUMN", "REVERSE_COLUMN", "FLIP_LR_COLUMN", "FLIP_UD_COLUMN")
    flags = {**dict(zip(names, FLAG_COLUMNS, strict=True)), "IN_FLOAT64": False,
             "BLOCK": pixel_kernel.BLOCK}
    per_thread = pixel_kernel.BLOCK // (32 * 4)  # Triton's default of 4 warps
    for truncate in (True, False):
        constants = {**flags, "TRUNCATE": truncate}
        source = ASTSource(pixel_kernel._pixel_ops_kernel,
                           {**signature, **dict.fromkeys(constants, "constexpr")}, constants)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                             options=pixel_kernel.COMPILE_OPTIONS).asm["ptx"]
        assert len(re.findall(r"\bfma\.rn\.f32\b", ptx)) == (2 + 3 * 3 + 2) * per_thread
        assert not re.findall(r"\bfma\.[a-z]+\.f64\b", ptx)


@pytest.mark.gpu
@pytest.mark.parametrize("truncate", [True, False], ids=["opencv5", "opencv4"])
def test_on_a_gpu_the_kernel_makes_the_cpu_references_bytes(truncate):
    images = random_images(16, 300, 340, seed=12)
    batch = recorded_batch(images, awkward_matrices(16, 320, 160, seed=13), (160, 120))
    want = PixelOps(truncate, fused=False)(dict(batch))["img"]
    on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    got = PixelOps(truncate, fused=True)(on_gpu)["img"]
    assert got.is_cuda and torch.equal(got.cpu(), want), (got.cpu() != want).sum()


@pytest.mark.gpu
def test_on_a_gpu_the_kernel_never_waits_for_the_device():
    images = random_images(4, 128, 128)
    batch = recorded_batch(images, random_matrices(4, 128, 64), (64, 64))
    on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    ops = PixelOps(truncate_hsv=True)
    ops(dict(on_gpu))  # builds the kernel
    assert ops.fused is True
    with host_syncs_raise():
        out = ops(dict(on_gpu))
    assert out["img"].shape == (4, 3, 64, 64)
