"""Ultralytics' per-pixel augmentation as batch tensor ops, on any device.

The random perspective warp (``cv2.warpAffine``, bilinear, border 114) and the HSV jitter
(``cv2.cvtColor`` to HSV, one 3-channel ``cv2.LUT``, back to BGR) are the costly per-pixel steps of
Ultralytics' training augmentation. Here they take a whole batch at once, as torch ops on any
device: on the CPU the reference, tested against OpenCV; on a GPU the route where Triton is
missing. With Triton, ``augment_device`` runs the same arithmetic as one fused kernel a batch
(:mod:`fastfeed.ultralytics.pixel_kernel`), tested against these ops: here each elementwise step
is a launch that reads and writes full-size temporaries, some 470 kernels a batch on a GPU.

The arithmetic is OpenCV's, step for step, rather than a generic resampler's. The warp inverts
the map in float64 and computes coordinates and interpolation in float32 with the fused
multiply-adds of OpenCV 5's x86 build, the border value standing in for every neighbour outside
the source (releases that quantise coordinates to 1/32 pixel differ by a grey level or two on
sharp edges). BGR→HSV is OpenCV's integer conversion, and HSV→BGR its float one, which OpenCV 5
truncates to uint8 and OpenCV 4 rounds. Against OpenCV 5 on the same parameters, on the CPU,
all three are bit-identical (``tests/test_ultralytics.py``). A fused multiply-add is computed
in float64 and rounded once to float32 on the CPU; on a GPU, from float32 operations alone, to
the same result (``tests/test_pixel_ops.py`` checks both on the CPU): no per-pixel step uses
float64 there. Parameters are drawn elsewhere, by Ultralytics' own code; these functions only
apply them.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

__all__ = ["bgr_to_hsv", "fma_float32", "hsv_lookup", "hsv_to_bgr", "source_region",
           "warp_affine", "warp_regions"]

_HSV_SHIFT = 12  # OpenCV's hsv_shift
_MARGIN = 2  # pixels around a region's bilinear neighbours (see source_region)


def _invert_affine(matrices: torch.Tensor) -> torch.Tensor:
    """Inverse maps of ``B×2×3`` forward affine matrices, in float64 as OpenCV computes them."""
    m = matrices.to(torch.float64)
    a, b, c = m[:, 0, 0], m[:, 0, 1], m[:, 0, 2]
    d, e, f = m[:, 1, 0], m[:, 1, 1], m[:, 1, 2]
    det = a * e - b * d
    inv_det = torch.where(det != 0, 1.0 / det, torch.zeros_like(det))
    ia, ib, id_, ie = e * inv_det, -b * inv_det, -d * inv_det, a * inv_det
    first = torch.stack([ia, ib, -ia * c - ib * f], -1)
    second = torch.stack([id_, ie, -id_ * c - ie * f], -1)
    return torch.stack([first, second], 1)


def source_region(matrix: np.ndarray, size: tuple[int, int], height: int, width: int
                  ) -> tuple[int, int, int, int]:
    """The part of a ``height``×``width`` source that a warp by ``matrix`` to ``size`` reads.

    Args:
        matrix: the 3×3 forward affine map (source → output pixel coordinates).
        size: output ``(width, height)``.

    Returns:
        ``(left, top, right, bottom)``, clipped to the source and at least one pixel, with a
        margin of two pixels around the bilinear neighbours of the output's corners, which
        covers the float32 rounding of the source coordinates :func:`warp_regions` computes.
    """
    if not np.linalg.det(matrix[:2, :2]):
        return 0, 0, width, height
    out_w, out_h = size
    corners = np.array([[0, out_w - 1, 0, out_w - 1], [0, 0, out_h - 1, out_h - 1], [1, 1, 1, 1]])
    xs, ys = (np.linalg.inv(matrix) @ corners)[:2]
    left = int(np.clip(np.floor(xs.min()) - _MARGIN, 0, width - 1))
    top = int(np.clip(np.floor(ys.min()) - _MARGIN, 0, height - 1))
    right = int(np.clip(np.floor(xs.max()) + 2 + _MARGIN, left + 1, width))
    bottom = int(np.clip(np.floor(ys.max()) + 2 + _MARGIN, top + 1, height))
    return left, top, right, bottom


def warp_affine(
    images: torch.Tensor, matrices: torch.Tensor, size: tuple[int, int], border: int = 114
) -> torch.Tensor:
    """Warp a batch like ``cv2.warpAffine(img, M, dsize=size, borderValue=border)`` per image.

    Args:
        images: ``B×H×W×C`` uint8 (channels last, as OpenCV holds them).
        matrices: ``B×2×3`` forward affine maps (source → output pixel coordinates).
        size: output ``(width, height)``.
        border: the value of every pixel outside the source.

    Returns:
        ``B×height×width×C`` uint8.
    """
    if images.dtype != torch.uint8 or images.dim() != 4:
        raise ValueError(f"images must be B×H×W×C uint8, got {tuple(images.shape)} {images.dtype}")
    batch, height, width, channels = images.shape
    zeros = torch.zeros(batch, dtype=torch.int64, device=images.device)
    first = torch.arange(batch, device=images.device) * (height * width)
    whole = torch.stack([first, zeros + height, zeros + width, zeros, zeros], 1)
    return warp_regions(images.reshape(-1, channels), whole, matrices, size, border)


def warp_regions(
    pixels: torch.Tensor, regions: torch.Tensor, matrices: torch.Tensor, size: tuple[int, int],
    border: int = 114,
) -> torch.Tensor:
    """:func:`warp_affine` of sources of which only a region each is given, packed together.

    The result is the warp of the whole sources wherever the regions hold every pixel the warp
    reads (:func:`source_region`): the source coordinates are computed as for the whole source,
    then shifted by the region's integer offset, which is exact in float32.

    Args:
        pixels: ``N×C`` uint8: the regions' pixels, row by row, one region after another.
        regions: ``B×5`` int64: the index in ``pixels`` of each region's first pixel, its
            height and width, and the source coordinates ``(left, top)`` of that pixel.
        matrices, size, border: as for :func:`warp_affine`; the matrices map whole sources.
    """
    if pixels.dtype != torch.uint8 or pixels.dim() != 2:
        raise ValueError(f"pixels must be N×C uint8, got {tuple(pixels.shape)} {pixels.dtype}")
    batch = regions.shape[0]
    if regions.shape != (batch, 5):
        raise ValueError(f"regions must be B×5, got {tuple(regions.shape)}")
    if matrices.shape != (batch, 2, 3):
        raise ValueError(f"matrices must be {batch}×2×3, got {tuple(matrices.shape)}")
    channels = pixels.shape[1]
    out_w, out_h = size
    device = pixels.device
    inverse = _invert_affine(matrices).to(device=device, dtype=torch.float32)
    first, height, width, left, top = regions.to(device).view(batch, 5, 1, 1).unbind(1)
    xs = torch.arange(out_w, device=device, dtype=torch.float32).view(1, 1, -1)
    ys = torch.arange(out_h, device=device, dtype=torch.float32).view(1, -1, 1)
    coeff = inverse.view(batch, 2, 3, 1, 1)
    # Source coordinates of every output pixel (B×h×w) as OpenCV 5 computes them:
    # fma(M0, x, y*M1 + M2), the row term unfused; then shifted into the region.
    sx = _fma(coeff[:, 0, 0], xs, ys * coeff[:, 0, 1] + coeff[:, 0, 2]) - left.to(torch.float32)
    sy = _fma(coeff[:, 1, 0], xs, ys * coeff[:, 1, 1] + coeff[:, 1, 2]) - top.to(torch.float32)
    x0, y0 = torch.floor(sx), torch.floor(sy)
    fx, fy = (sx - x0).unsqueeze(-1), (sy - y0).unsqueeze(-1)
    x0, y0 = x0.to(torch.int64), y0.to(torch.int64)

    def neighbour(dy: int, dx: int) -> torch.Tensor:  # B×h×w×C float, border outside the source
        xi, yi = x0 + dx, y0 + dy
        inside = (xi >= 0) & (xi < width) & (yi >= 0) & (yi < height)
        row = torch.minimum(yi.clamp(min=0), height - 1)
        index = first + row * width + torch.minimum(xi.clamp(min=0), width - 1)
        values = pixels[index.view(-1)].view(batch, out_h, out_w, channels).to(torch.float32)
        return torch.where(inside.unsqueeze(-1), values, float(border))

    # OpenCV's order: across each row, then down, each step one fused multiply-add.
    upper, lower = neighbour(0, 0), neighbour(1, 0)
    upper = _fma(fx, neighbour(0, 1) - upper, upper)
    lower = _fma(fx, neighbour(1, 1) - lower, lower)
    return torch.round(_fma(fy, lower - upper, upper)).clamp(0, 255).to(torch.uint8)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | float) -> torch.Tensor:
    """``a*b + c`` rounded once to float32, as OpenCV's ``v_fma``.

    On the CPU, in float64 (the reference): float64 holds the product of two float32s exactly,
    and the sum too unless their magnitudes are far apart. On a GPU, float64 runs at 1/32 to
    1/64 of float32's rate on consumer cards and would take full-size temporaries twice as
    large, so there the same result comes from float32 arithmetic alone (:func:`fma_float32`).
    """
    if a.device.type == "cpu":
        product = a.to(torch.float64) * b.to(torch.float64)
        return (product + (c.to(torch.float64) if isinstance(c, torch.Tensor) else c)).to(
            torch.float32)
    return fma_float32(a, b, c)


def _split(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Veltkamp: a == high + low exactly, each with at most 12 of float32's 24 significant bits,
    # so that products of halves are exact.
    scaled = a * 4097.0  # 2**12 + 1
    high = scaled - (scaled - a)
    return high, a - high


def _two_sum(a: torch.Tensor | float, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Knuth: a + b == total + error exactly.
    total = a + b
    b_part = total - a
    return total, (a - (total - b_part)) + (b - b_part)


def _round_to_odd_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # a + b rounded to the neighbour with an odd last bit where it is not exact: a second
    # rounding to nearest of a value rounded to odd then equals one rounding of the exact one.
    total, error = _two_sum(a, b)
    even = (total.view(torch.int32) & 1) == 0
    away = torch.nextafter(total, torch.where(error > 0, torch.inf, -torch.inf).to(total))
    return torch.where((error != 0) & even, away, total)


def fma_float32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | float) -> torch.Tensor:
    """``a*b + c`` rounded once to float32, computed with float32 operations only.

    Boldo and Melquiond's emulation (2008): the exact product as ``p + e`` (Veltkamp and
    Dekker), ``c + p`` as ``s + t`` (TwoSum), then ``s + RO(t + e)`` with ``RO`` rounding to
    odd. Exact for float32 inputs without overflow whose products are not subnormal. Each
    elementwise op is its own kernel in eager PyTorch, so no compiler fuses (and so changes)
    the roundings it relies on.

    The float64 reference of :func:`_fma` rounds twice (to float64, then float32); the two
    differ only where the exact sum needs more than float64's 53 bits and its float64
    rounding lands exactly half-way between two float32s.
    """
    a, b = a.to(torch.float32), b.to(torch.float32)
    # A Python number stays one (rounded to float32 here): made a tensor on a GPU, it would
    # be a blocking host-to-device copy on every call.
    c = c.to(torch.float32) if isinstance(c, torch.Tensor) else float(np.float32(c))
    product = a * b
    a_high, a_low = _split(a)
    b_high, b_low = _split(b)
    product_error = ((a_high * b_high - product) + a_high * b_low + a_low * b_high) + a_low * b_low
    high, low = _two_sum(c, product)
    return high + _round_to_odd_sum(low, product_error)


# The tables are made once per device: building a tensor from Python data on every batch would
# make the host wait for the device's copy stream.
@cache
def _division_table(numerator: int, device: torch.device) -> torch.Tensor:
    # OpenCV's sdiv_table / hdiv_table180: numerator / i rounded half to even (cvRound), 0 for
    # i = 0; in integers, exactly.
    i = torch.arange(256, dtype=torch.int64, device=device).clamp(min=1)
    quotient, remainder = numerator // i, numerator % i
    up = (2 * remainder > i) | ((2 * remainder == i) & (quotient % 2 == 1))
    table = torch.where(up, quotient + 1, quotient)
    table[0] = 0
    return table.to(torch.int32)


def bgr_to_hsv(images: torch.Tensor) -> torch.Tensor:
    """``cv2.cvtColor(img, cv2.COLOR_BGR2HSV)`` for uint8 ``…×3`` BGR: H in [0, 180), S, V."""
    b, g, r = images.to(torch.int32).unbind(-1)
    v = torch.maximum(torch.maximum(b, g), r)
    diff = v - torch.minimum(torch.minimum(b, g), r)
    round_half = 1 << (_HSV_SHIFT - 1)
    s_table = _division_table(255 << _HSV_SHIFT, images.device)
    h_table = _division_table((180 << _HSV_SHIFT) // 6, images.device)
    s = (diff * s_table[v] + round_half) >> _HSV_SHIFT
    h = torch.where(v == r, g - b, torch.where(v == g, b - r + 2 * diff, r - g + 4 * diff))
    h = (h * h_table[diff] + round_half) >> _HSV_SHIFT
    h = torch.where(h < 0, h + 180, h)
    return torch.stack([h, s, v], -1).to(torch.uint8)


@cache
def _sectors(device: torch.device) -> torch.Tensor:
    # For each sector of the hue circle, which of (v, p, q, t) is blue, green and red.
    sectors = ((1, 3, 0), (1, 0, 2), (3, 0, 1), (0, 2, 1), (0, 1, 3), (2, 1, 0))
    return torch.tensor(sectors, device=device)


def hsv_to_bgr(hsv: torch.Tensor, truncate: bool = True) -> torch.Tensor:
    """``cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)`` for uint8 ``…×3`` HSV with H in [0, 180).

    ``truncate``: OpenCV 5 truncates the float result to uint8, OpenCV 4 rounds it. (The OpenCV
    5.0 tested here truncates in its vector loop only: it rounds the last ``width % 32`` pixels
    of each row. Ultralytics' image sizes are multiples of 32.)
    """
    h, s, v = hsv.to(torch.float32).unbind(-1)
    s, v = s * (1.0 / 255.0), v * (1.0 / 255.0)
    h = h * (6.0 / 180.0)
    h = torch.where(h >= 6, h - 6, h)
    sector = torch.floor(h)
    frac = h - sector
    sector = sector.to(torch.int64).clamp(0, 5)
    # OpenCV's x86 build (AVX2) fuses each 1 - s*h into one multiply-add.
    tab = torch.stack([v, v * (1 - s), v * _fma(-s, frac, 1.0), v * _fma(-s, 1 - frac, 1.0)], -1)
    order = _sectors(hsv.device)[sector]  # …×3 indices into tab
    bgr = torch.gather(tab, -1, order)
    bgr = torch.where((s == 0).unsqueeze(-1), v.unsqueeze(-1).expand_as(bgr), bgr)
    bgr = bgr * 255.0
    return (torch.trunc(bgr) if truncate else torch.round(bgr)).clamp(0, 255).to(torch.uint8)


def hsv_lookup(
    images: torch.Tensor, luts: torch.Tensor, apply: torch.Tensor, truncate: bool = True
) -> torch.Tensor:
    """Ultralytics' ``RandomHSV`` on a batch, with each image's lookup table already drawn.

    Args:
        images: ``B×H×W×3`` uint8 BGR.
        luts: ``B×3×256`` uint8: the hue, saturation and value tables ``RandomHSV`` built.
        apply: ``B`` bool: images ``RandomHSV`` left alone (all gains zero) keep their pixels.
        truncate: how HSV→BGR makes integers (see :func:`hsv_to_bgr`).

    Returns:
        ``B×H×W×3`` uint8 BGR.
    """
    hsv = bgr_to_hsv(images).to(torch.int64)
    batch = images.shape[0]
    offsets = (torch.arange(batch, device=images.device) * 3).view(batch, 1, 1, 1)
    channel = torch.arange(3, device=images.device)
    flat = luts.to(images.device).reshape(-1, 256)
    mapped = flat[offsets + channel, hsv].view_as(hsv)
    out = hsv_to_bgr(mapped, truncate)
    return torch.where(apply.to(images.device).view(batch, 1, 1, 1), out, images)
