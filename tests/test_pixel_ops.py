"""The batch pixel ops behind ``augment_device``, without OpenCV: exact cases, the float32-only
arithmetic GPUs use against the float64 CPU reference (on the CPU), and the device against the
CPU. (Their comparison with OpenCV runs in the client environment: ``test_ultralytics.py``.)"""

import numpy as np
import pytest
import torch
from helpers import host_syncs_raise
from pixel_batches import params, recorded

from fastfeed.ultralytics import pixel_ops
from fastfeed.ultralytics.gpu_augment import PARAM_COLUMNS, PixelOps
from fastfeed.ultralytics.pixel_ops import (
    bgr_to_hsv,
    fma_float32,
    hsv_lookup,
    hsv_to_bgr,
    source_region,
    warp_affine,
    warp_regions,
)

REFERENCE_FMA = pixel_ops._fma  # float64 on the CPU


def random_images(batch=3, height=48, width=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, height, width, 3), dtype=torch.uint8, generator=g)


def test_integer_translation_shifts_and_fills_the_border():
    images = random_images()
    shift = torch.tensor([[1.0, 0.0, 5.0], [0.0, 1.0, -3.0]]).expand(3, 2, 3)
    out = warp_affine(images, shift, (64, 48), border=114)
    assert torch.equal(out[:, :45, 5:], images[:, 3:, :59])
    assert (out[:, :, :5] == 114).all() and (out[:, 45:] == 114).all()


def test_identity_and_mirror():
    images = random_images()
    identity = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]).expand(3, 2, 3)
    assert torch.equal(warp_affine(images, identity, (64, 48)), images)
    mirror = torch.tensor([[-1.0, 0.0, 63.0], [0.0, 1.0, 0.0]]).expand(3, 2, 3)
    assert torch.equal(warp_affine(images, mirror, (64, 48)), images.flip(2))


def test_warp_rejects_bad_input():
    with pytest.raises(ValueError, match="uint8"):
        warp_affine(torch.zeros(1, 4, 4, 3), torch.zeros(1, 2, 3), (4, 4))
    with pytest.raises(ValueError, match="1×2×3"):
        warp_affine(torch.zeros(1, 4, 4, 3, dtype=torch.uint8), torch.zeros(2, 3), (4, 4))


def random_matrices(batch, canvas, size, seed=0):
    """Forward maps like Ultralytics' random perspective: rotation, scale 0.3–1.7 and shear
    about the canvas centre, a translation that may push the output off the canvas; some
    mirrored as RandomFlip folds them."""
    rng = np.random.default_rng(seed)
    matrices = []
    for i in range(batch):
        angle, scale = rng.uniform(-np.pi, np.pi), rng.uniform(0.3, 1.7)
        shear = np.eye(3)
        shear[0, 1], shear[1, 0] = np.tan(rng.uniform(-0.2, 0.2, 2))
        rotate = np.array([[scale * np.cos(angle), -scale * np.sin(angle), 0],
                           [scale * np.sin(angle), scale * np.cos(angle), 0], [0, 0, 1]])
        centre, move = np.eye(3), np.eye(3)
        centre[:2, 2] = -canvas / 2
        move[:2, 2] = rng.uniform(-0.5, 1.5, 2) * size
        m = move @ shear @ rotate @ centre
        if i % 2:
            m = np.array([[-1, 0, size - 1], [0, 1, 0], [0, 0, 1]]) @ m
        matrices.append(m)
    return np.stack(matrices)


def pack(images, matrices, size):
    """Each image's source_region, packed as warp_regions takes them."""
    crops, regions, first = [], [], 0
    for image, matrix in zip(images, matrices, strict=True):
        left, top, right, bottom = source_region(matrix, size, *image.shape[:2])
        crops.append(image[top:bottom, left:right].reshape(-1, 3))
        regions.append([first, bottom - top, right - left, left, top])
        first += (bottom - top) * (right - left)
    return torch.cat(crops), torch.tensor(regions)


def test_regions_warp_exactly_as_whole_sources():
    images = random_images(12, 160, 200, seed=3)
    matrices = random_matrices(12, 180, 96)
    pixels, regions = pack(images, matrices, (96, 96))
    assert len(pixels) < images[:, :, :, 0].numel()  # most outputs read part of their source
    expected = warp_affine(images, torch.from_numpy(matrices[:, :2]), (96, 96))
    got = warp_regions(pixels, regions, torch.from_numpy(matrices[:, :2]), (96, 96))
    assert torch.equal(got, expected)


def test_source_region_is_clipped_and_never_empty():
    off_canvas = np.array([[1.0, 0, -500], [0, 1, -500], [0, 0, 1]])
    assert source_region(off_canvas, (32, 32), 100, 100) == (99, 99, 100, 100)
    assert source_region(np.eye(3), (300, 300), 100, 100) == (0, 0, 100, 100)
    singular = np.array([[0.0, 0, 0], [0, 0, 0], [0, 0, 1]])
    assert source_region(singular, (32, 32), 100, 100) == (0, 0, 100, 100)


def test_hsv_of_primaries():
    bgr = torch.tensor([[255, 0, 0], [0, 255, 0], [0, 0, 255], [0, 0, 0], [90, 90, 90]],
                       dtype=torch.uint8)
    assert bgr_to_hsv(bgr).tolist() == [[120, 255, 255], [60, 255, 255], [0, 255, 255],
                                        [0, 0, 0], [0, 0, 90]]
    assert torch.equal(hsv_to_bgr(bgr_to_hsv(bgr)), bgr)


def test_identity_lut_is_the_hsv_round_trip_and_apply_false_keeps_pixels():
    images = random_images()
    identity = torch.arange(256, dtype=torch.uint8).expand(3, 3, 256)
    out = hsv_lookup(images, identity, torch.tensor([True, False, True]))
    assert torch.equal(out[0], hsv_to_bgr(bgr_to_hsv(images[0])))
    assert torch.equal(out[1], images[1])


@pytest.mark.gpu
def test_device_matches_cpu():
    images = random_images(batch=4, height=320, width=320, seed=1)
    g = torch.Generator().manual_seed(2)
    angle = torch.rand(4, generator=g) - 0.5
    scale = 0.6 + torch.rand(4, generator=g)
    matrices = torch.stack([
        torch.stack([scale * angle.cos(), -scale * angle.sin(), torch.full((4,), 20.0)], -1),
        torch.stack([scale * angle.sin(), scale * angle.cos(), torch.full((4,), -10.0)], -1),
    ], 1)
    luts = torch.randint(0, 256, (4, 3, 256), dtype=torch.uint8, generator=g)
    luts[:, 0] %= 180
    apply = torch.tensor([True, True, False, True])

    def run(device):
        warped = warp_affine(images.to(device), matrices.to(device), (160, 160))
        return warped.cpu(), hsv_lookup(warped, luts.to(device), apply.to(device)).cpu()

    (warp_cpu, out_cpu), (warp_gpu, out_gpu) = run("cpu"), run("cuda")
    # float64 multiply-adds on the CPU, float32-only ones on the GPU: the same bytes
    assert torch.equal(warp_cpu, warp_gpu) and torch.equal(out_cpu, out_gpu)


@pytest.mark.gpu
def test_pixel_ops_never_wait_for_the_device():
    """PixelOps runs on the loader's copy stream from the training thread: it must only
    enqueue work, never read a device value back."""

    ops = PixelOps(truncate_hsv=True, fused=False)  # the kernel's: test_pixel_kernel.py
    matrices = random_matrices(2, 128, 64)
    pixels, regions = pack(random_images(2, 128, 128), matrices, (64, 64))
    luts = torch.arange(256, dtype=torch.uint8).expand(2, 3, 256).contiguous()
    batch = recorded(pixels.cuda(), params(matrices, [0b1111] * 2).cuda(), luts.cuda(),
                     regions.cuda(), (64, 64))
    ops(dict(batch))  # the first call makes the per-device tables
    with host_syncs_raise():
        out = ops(dict(batch))
    assert out["img"].shape == (2, 3, 64, 64) and out["img"].is_cuda


def realistic_floats(count, seed):
    """float32 values across the magnitudes the ops meet (2**-20 to 2**12), both signs."""
    g = torch.Generator().manual_seed(seed)
    mantissa = torch.rand(count, generator=g) * 2 - 1
    return mantissa * torch.pow(2.0, torch.randint(-20, 12, (count,), generator=g).float())


def test_fma_float32_rounds_the_exact_sum_once():
    from fractions import Fraction

    a, b, c = (realistic_floats(3000, seed) for seed in range(3))
    got = fma_float32(a, b, c)
    for x, y, z, result in zip(a.tolist(), b.tolist(), c.tolist(), got.tolist(), strict=True):
        exact = Fraction(x) * Fraction(y) + Fraction(z)
        below = np.nextafter(np.float32(result), np.float32(-np.inf))
        above = np.nextafter(np.float32(result), np.float32(np.inf))
        error = abs(Fraction(result) - exact)
        assert error <= abs(Fraction(float(below)) - exact), (x, y, z)
        assert error <= abs(Fraction(float(above)) - exact), (x, y, z)


def test_fma_float32_equals_the_float64_reference():
    a, b, c = (realistic_floats(1_000_000, seed) for seed in range(3, 6))
    assert torch.equal(fma_float32(a, b, c), pixel_ops._fma(a, b, c))


def test_where_float64_rounds_twice_fma_float32_is_the_true_fma():
    # 8390624 * 16773185 == 2**47 + 262112: the product is 2 plus 2**-46 * 262112; with 2**25
    # the exact sum lies just above a float32 midpoint, and float64 rounds it onto it.
    a = torch.tensor([8390624 * 2.0**-23])
    b = torch.tensor([16773185 * 2.0**-23])
    c = torch.tensor([2.0**25])
    assert fma_float32(a, b, c).item() == 2.0**25 + 4  # nearest to 2**25 + 2 + 3.7e-9
    assert pixel_ops._fma(a, b, c).item() == 2.0**25  # double rounding, then ties to even


@pytest.fixture
def float32_arithmetic(monkeypatch):
    """The ops on the CPU with the float32-only multiply-add that GPUs use, every call of it
    checked against the float64 reference; yields how many values were checked."""
    checked = []

    def checked_fma(a, b, c):
        got = fma_float32(a, b, c)
        assert torch.equal(got, REFERENCE_FMA(a, b, c))
        checked.append(got.numel())
        return got

    monkeypatch.setattr(pixel_ops, "_fma", checked_fma)
    yield checked


def test_hsv_to_bgr_with_float32_arithmetic_equals_the_reference_for_every_input(
        float32_arithmetic):
    # The multiply-adds see only hue and saturation: every pair, at a few values.
    h, s = torch.meshgrid(torch.arange(180), torch.arange(256), indexing="ij")
    v = torch.tensor([1, 77, 128, 255]).view(-1, 1, 1).expand(4, 180, 256)
    hsv = torch.stack([h.expand(4, -1, -1), s.expand(4, -1, -1), v], -1).to(torch.uint8)
    for truncate in (True, False):
        hsv_to_bgr(hsv, truncate)
    assert sum(float32_arithmetic) == 2 * 2 * hsv[..., 0].numel()


def test_warps_with_float32_arithmetic_equal_the_reference(float32_arithmetic):
    images = random_images(16, 160, 200, seed=5)
    matrices = random_matrices(16, 180, 96, seed=6)
    # exact quarter turns give coefficients of about 1e-8 beside ones
    quarter = np.array([[np.cos(np.pi / 2), -1.0, 150.0], [1.0, np.cos(np.pi / 2), -20.0],
                        [0, 0, 1]])
    matrices[:2] = quarter
    forward = torch.from_numpy(matrices[:, :2])
    warp_affine(images, forward, (96, 96))
    pixels, regions = pack(images, matrices, (96, 96))
    warp_regions(pixels, regions, forward, (96, 96))
    assert len(float32_arithmetic) == 2 * 5


def test_pixel_ops_off_the_cpu_take_no_float64_per_pixel():
    """Traced on the meta device (shapes only, like a GPU it is not the CPU): no float64
    tensor larger than the per-image parameters."""
    from torch.utils._python_dispatch import TorchDispatchMode


    batch, side = 4, 64

    class Float64Sizes(TorchDispatchMode):
        sizes: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float64:
                    self.sizes.append(tensor.numel())
            return out

    regions = torch.tensor([[i * side * side, side, side, 0, 0] for i in range(batch)])
    identity = [[[1, 0, 0], [0, 1, 0]]] * batch
    data = recorded(torch.zeros(batch * side * side, 3, dtype=torch.uint8),
                    params(identity, [0b0001] * batch),
                    torch.zeros(batch, 3, 256, dtype=torch.uint8), regions, (side, side))
    data = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in data.items()}
    with Float64Sizes() as trace:
        out = PixelOps(truncate_hsv=True)(data)
    assert out["img"].shape == (batch, 3, side, side)
    assert max(trace.sizes, default=0) <= batch * PARAM_COLUMNS, trace.sizes
