"""The ``augment_device`` pixel ops of a whole batch as one Triton kernel launch.

:mod:`fastfeed.ultralytics.pixel_ops` computes the warp, the HSV jitter, the flips and the
channel order with torch ops: some 470 kernel launches a batch whatever its size, each reading
and writing full-size temporaries (on a GPU its float32 multiply-add alone is two dozen ops, as
eager torch has none). Here one program computes a block of output pixels of one image
from the first step to the last in registers, and writes each ``B×3×H×W`` uint8 byte once:

* the output pixel a flip sends it to, and the warp's source coordinates there, from the inverse
  of the image's matrix (made in float64 by each program, as OpenCV makes it);
* its four bilinear neighbours from the packed canvas parts, the border value outside them;
* OpenCV's integer BGR→HSV, the image's three lookup tables, OpenCV's float HSV→BGR;
* the channel order ``Format`` drew, stored plane by plane.

The arithmetic is that of :mod:`~fastfeed.ultralytics.pixel_ops` (and so OpenCV's) step for
step, with the same roundings: where OpenCV fuses a multiply-add, the kernel calls ``tl.fma``
(CUDA's ``fma.rn.f32``), and it is compiled with ``enable_fp_fusion=False`` so that no other
multiply and add are contracted into one. The torch ops stay the reference (on the CPU) and the
route where Triton is missing.

Why Triton rather than fewer, larger torch ops or CV-CUDA: torch ops still move every
temporary through memory and have no fused multiply-add; CV-CUDA is neither a dependency of
torch nor installed where this was written, and whether its operators give OpenCV's bytes is
unknown. Triton ships with torch's CUDA wheels on Linux, and can be tested without a GPU: its
interpreter (``TRITON_INTERPRET=1``) runs this very kernel on CPU tensors, and its compiler
builds it for an H100 on any machine, where the PTX shows which multiply-adds are fused
(``tests/test_pixel_kernel.py``). The interpreter's ``tl.fma`` rounds twice (numpy's
``a*b + c``), so on the CPU the kernel computes its multiply-adds in float64 instead, as the
torch reference does there.

Importing this module needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["apply_pixel_ops"]

# Output pixels per program: two per thread of its four warps keep the kernel at 48 registers
# on sm_90 (ptxas), so that 40 of an SM's 64 warps can be resident to hide the latency of the
# gathers; 1,024 took 150 registers.
BLOCK = 256
# No multiply and add contracted into one but the fma calls (Triton contracts by default).
COMPILE_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _fma(a, b, c, IN_FLOAT64: tl.constexpr):
    # a*b + c rounded once to float32 (in float64 on the interpreter: see the module's notes)
    if IN_FLOAT64:
        return (a.to(tl.float64) * b.to(tl.float64) + c).to(tl.float32)
    else:
        return tl.fma(a, b, c)


@triton.jit
def _round_half_even(x):
    # torch.round / OpenCV's cvRound, from exact steps (x - floor(x) is exact)
    low = tl.floor(x)
    frac = x - low
    odd = (low.to(tl.int32) & 1) == 1
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), low + 1.0, low)


@triton.jit
def _neighbour(pixels, first, height, width, xi, yi, valid, border):
    # The B, G, R of the region's pixel at integer-valued float coordinates, the border outside
    # it; tested as floats, so that no coordinate far off the canvas overflows an integer.
    inside = valid & (xi >= 0) & (xi < width.to(tl.float32)) & (yi >= 0) & (
        yi < height.to(tl.float32))
    col = tl.minimum(tl.maximum(xi, 0.0), (width - 1).to(tl.float32)).to(tl.int64)
    row = tl.minimum(tl.maximum(yi, 0.0), (height - 1).to(tl.float32)).to(tl.int64)
    at = pixels + (first + row * width + col) * 3
    blue = tl.where(inside, tl.load(at, mask=inside).to(tl.float32), border)
    green = tl.where(inside, tl.load(at + 1, mask=inside).to(tl.float32), border)
    red = tl.where(inside, tl.load(at + 2, mask=inside).to(tl.float32), border)
    return blue, green, red


@triton.jit
def _bilinear(upper_left, upper_right, lower_left, lower_right, fx, fy,
              IN_FLOAT64: tl.constexpr):
    # OpenCV's order: across each row, then down, each step one fused multiply-add.
    upper = _fma(fx, upper_right - upper_left, upper_left, IN_FLOAT64)
    lower = _fma(fx, lower_right - lower_left, lower_left, IN_FLOAT64)
    value = _round_half_even(_fma(fy, lower - upper, upper, IN_FLOAT64))
    return tl.minimum(tl.maximum(value, 0.0), 255.0).to(tl.int32)


@triton.jit
def _divide(numerator: tl.constexpr, divisor):
    # OpenCV's sdiv_table / hdiv_table180 entries: numerator / divisor rounded half to even,
    # 0 for 0; in integers, exactly.
    d = tl.maximum(divisor, 1)
    quotient = numerator // d
    twice_rest = 2 * (numerator - quotient * d)
    up = (twice_rest > d) | ((twice_rest == d) & ((quotient & 1) == 1))
    return tl.where(divisor == 0, 0, quotient + up.to(tl.int32))


@triton.jit
def _to_byte(x, TRUNCATE: tl.constexpr):
    # HSV→BGR's float to uint8: OpenCV 5 truncates, OpenCV 4 rounds; never negative here.
    scaled = x * 255.0
    whole = tl.floor(scaled) if TRUNCATE else _round_half_even(scaled)
    return tl.minimum(whole, 255.0).to(tl.int32)


@triton.jit
def _hsv_jitter(blue, green, red, lut, TRUNCATE: tl.constexpr, IN_FLOAT64: tl.constexpr):
    # BGR→HSV as OpenCV's integer conversion (hsv_shift 12), the three tables, then HSV→BGR as
    # its float one (see pixel_ops.bgr_to_hsv and hsv_to_bgr).
    v = tl.maximum(tl.maximum(blue, green), red)
    diff = v - tl.minimum(tl.minimum(blue, green), red)
    s = (diff * _divide(255 << 12, v) + (1 << 11)) >> 12
    h = tl.where(v == red, green - blue,
                 tl.where(v == green, blue - red + 2 * diff, red - green + 4 * diff))
    h = (h * _divide((180 << 12) // 6, diff) + (1 << 11)) >> 12
    h = tl.where(h < 0, h + 180, h)
    h = tl.load(lut + h).to(tl.float32) * (6.0 / 180.0)
    s = tl.load(lut + 256 + s).to(tl.float32) * (1.0 / 255.0)
    v = tl.load(lut + 512 + v).to(tl.float32) * (1.0 / 255.0)
    h = tl.where(h >= 6, h - 6, h)
    sector = tl.floor(h)
    frac = h - sector
    sector = tl.minimum(tl.maximum(sector.to(tl.int32), 0), 5)
    p = v * (1 - s)
    q = v * _fma(-s, frac, 1.0, IN_FLOAT64)
    t = v * _fma(-s, 1 - frac, 1.0, IN_FLOAT64)
    # Sector by sector, (blue, green, red) is (p, t, v), (p, v, q), (t, v, p), (v, q, p),
    # (v, p, t), (q, p, v); grey (s == 0) is v everywhere.
    grey = s == 0
    new_blue = tl.where(sector < 2, p, tl.where(sector == 2, t, tl.where(sector == 5, q, v)))
    new_green = tl.where(sector == 0, t, tl.where(sector == 3, q,
                                                   tl.where(sector >= 4, p, v)))
    new_red = tl.where(sector == 1, q, tl.where((sector == 2) | (sector == 3), p,
                                                 tl.where(sector == 4, t, v)))
    return (_to_byte(tl.where(grey, v, new_blue), TRUNCATE),
            _to_byte(tl.where(grey, v, new_green), TRUNCATE),
            _to_byte(tl.where(grey, v, new_red), TRUNCATE))


@triton.jit
def _pixel_ops_kernel(
    pixels, regions, params, luts, out, out_h, out_w, params_stride, border,
    HSV_COLUMN: tl.constexpr, REVERSE_COLUMN: tl.constexpr, FLIP_LR_COLUMN: tl.constexpr,
    FLIP_UD_COLUMN: tl.constexpr, TRUNCATE: tl.constexpr, IN_FLOAT64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    image = tl.program_id(1).to(tl.int64)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    area = out_h * out_w
    valid = offsets < area
    y = offsets // out_w
    x = offsets - y * out_w

    row = params + image * params_stride
    a, b, c = tl.load(row), tl.load(row + 1), tl.load(row + 2)
    d, e, f = tl.load(row + 3), tl.load(row + 4), tl.load(row + 5)
    # The inverse map, in float64 as OpenCV (and pixel_ops._invert_affine) computes it.
    det = a * e - b * d
    inv_det = tl.where(det != 0, 1.0 / tl.where(det != 0, det, 1.0), 0.0)
    ia, ib, id_, ie = e * inv_det, -b * inv_det, -d * inv_det, a * inv_det
    m00, m01, m02 = ia.to(tl.float32), ib.to(tl.float32), (-ia * c - ib * f).to(tl.float32)
    m10, m11, m12 = id_.to(tl.float32), ie.to(tl.float32), (-id_ * c - ie * f).to(tl.float32)

    # Flips act on the output: this pixel shows the warp at the mirrored position.
    xo = tl.where(tl.load(row + FLIP_LR_COLUMN) > 0, out_w - 1 - x, x).to(tl.float32)
    yo = tl.where(tl.load(row + FLIP_UD_COLUMN) > 0, out_h - 1 - y, y).to(tl.float32)
    region = regions + image * 5
    first, height, width = tl.load(region), tl.load(region + 1), tl.load(region + 2)
    left, top = tl.load(region + 3).to(tl.float32), tl.load(region + 4).to(tl.float32)
    # fma(M0, x, y*M1 + M2), the row term unfused, as OpenCV 5; then shifted into the region.
    sx = _fma(m00, xo, yo * m01 + m02, IN_FLOAT64) - left
    sy = _fma(m10, xo, yo * m11 + m12, IN_FLOAT64) - top
    x0, y0 = tl.floor(sx), tl.floor(sy)
    fx, fy = sx - x0, sy - y0
    b00, g00, r00 = _neighbour(pixels, first, height, width, x0, y0, valid, border)
    b01, g01, r01 = _neighbour(pixels, first, height, width, x0 + 1, y0, valid, border)
    b10, g10, r10 = _neighbour(pixels, first, height, width, x0, y0 + 1, valid, border)
    b11, g11, r11 = _neighbour(pixels, first, height, width, x0 + 1, y0 + 1, valid, border)
    blue = _bilinear(b00, b01, b10, b11, fx, fy, IN_FLOAT64)
    green = _bilinear(g00, g01, g10, g11, fx, fy, IN_FLOAT64)
    red = _bilinear(r00, r01, r10, r11, fx, fy, IN_FLOAT64)

    if tl.load(row + HSV_COLUMN) > 0:
        lut = luts + image * 768
        blue, green, red = _hsv_jitter(blue, green, red, lut, TRUNCATE, IN_FLOAT64)

    plane = out + image * 3 * area + offsets
    reverse = tl.load(row + REVERSE_COLUMN) > 0
    tl.store(plane, tl.where(reverse, red, blue).to(tl.uint8), mask=valid)
    tl.store(plane + area, green.to(tl.uint8), mask=valid)
    tl.store(plane + 2 * area, tl.where(reverse, blue, red).to(tl.uint8), mask=valid)


def _require(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]
             ) -> None:
    if tensor.dtype != dtype or tensor.shape != shape:
        raise ValueError(f"fastfeed: {name} must be {'×'.join(map(str, shape))} {dtype}, got "
                         f"{'×'.join(map(str, tensor.shape))} {tensor.dtype}")


def apply_pixel_ops(
    pixels: torch.Tensor, regions: torch.Tensor, params: torch.Tensor, luts: torch.Tensor,
    size: tuple[int, int], border: int, truncate: bool, columns: tuple[int, int, int, int],
) -> torch.Tensor:
    """Warp, HSV, flips and channel order of a batch, as one kernel launch.

    Args:
        pixels: ``N×3`` uint8, the canvas parts packed (see
            :func:`~fastfeed.ultralytics.pixel_ops.warp_regions`).
        regions: ``B×5`` int64, as ``warp_regions`` takes them.
        params: ``B×P`` float64 rows: the forward 2×3 matrix in the first six columns, then
            flags (true where above 0).
        luts: ``B×3×256`` uint8: the hue, saturation and value tables.
        size: output ``(width, height)``.
        border: the value of every pixel outside the source.
        truncate: HSV→BGR truncates (OpenCV 5) or rounds (OpenCV 4).
        columns: the columns of ``params`` that say: apply HSV, reverse the channels, mirror
            left-right, mirror upside down.

    Returns:
        ``B×3×height×width`` uint8 on ``pixels``' device, queued on the current stream: the
        host reads nothing back. On the CPU it needs ``TRITON_INTERPRET=1`` (tests).
    """
    batch = regions.shape[0]
    out_w, out_h = size
    # The kernel is built for these types: it would read any other as them.
    _require("pixels", pixels, torch.uint8, (pixels.shape[0], 3))
    _require("regions", regions, torch.int64, (batch, 5))
    _require("params", params, torch.float64, (batch, max(6, *columns) + 1))
    _require("luts", luts, torch.uint8, (batch, 3, 256))
    pixels, regions, params, luts = (t.contiguous() for t in (pixels, regions, params, luts))
    out = torch.empty(batch, 3, out_h, out_w, dtype=torch.uint8, device=pixels.device)
    if batch == 0 or out_h * out_w == 0:
        return out
    hsv, reverse, flip_lr, flip_ud = columns
    grid = (triton.cdiv(out_h * out_w, BLOCK), batch)
    _pixel_ops_kernel[grid](
        pixels, regions, params, luts, out, out_h, out_w, params.shape[1], float(border),
        HSV_COLUMN=hsv, REVERSE_COLUMN=reverse, FLIP_LR_COLUMN=flip_lr, FLIP_UD_COLUMN=flip_ud,
        TRUNCATE=truncate, IN_FLOAT64=pixels.device.type == "cpu", BLOCK=BLOCK,
        **COMPILE_OPTIONS,
    )
    return out
