"""The batch pixel ops behind ``augment_device``, without OpenCV: exact cases, and the device
against the CPU. (Their comparison with OpenCV runs in the client environment:
``test_ultralytics.py``.)"""

import pytest
import torch

from fastfeed.ultralytics.pixel_ops import bgr_to_hsv, hsv_lookup, hsv_to_bgr, warp_affine


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
    # float32 on either side; fused multiply-adds may round a handful of values differently
    for cpu, gpu in ((warp_cpu, warp_gpu), (out_cpu, out_gpu)):
        diff = (cpu.int() - gpu.int()).abs()
        assert (diff > 0).float().mean() < 0.001 and diff.max() <= 16


@pytest.mark.gpu
def test_pixel_ops_never_wait_for_the_device():
    """PixelOps runs on the loader's copy stream from the training thread: it must only
    enqueue work, never read a device value back."""
    from fastfeed.ultralytics.gpu_augment import LUT_KEY, PARAMS_KEY, SIZE_KEY, PixelOps

    ops = PixelOps(truncate_hsv=True)
    params = torch.zeros(2, 8, dtype=torch.float64)
    params[:, 0] = params[:, 4] = 0.5
    params[:, 6:8] = 1
    batch = {"img": random_images(2, 128, 128).cuda(), PARAMS_KEY: params.cuda(),
             LUT_KEY: torch.arange(256, dtype=torch.uint8).expand(2, 3, 256).contiguous().cuda(),
             SIZE_KEY: (64, 64)}
    ops(dict(batch))  # the first call makes the per-device tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ops(dict(batch))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out["img"].shape == (2, 3, 64, 64) and out["img"].is_cuda
