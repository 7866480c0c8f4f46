"""Crop, resize, flip, convert and normalise a batch of images of different sizes at once.

Every image of a batch has its own crop window and flip, and the crops differ in size, so one
``interpolate`` call per image would be the obvious way: several kernels an image. Here the
host knows everything that varies (the windows and flips were drawn by the workers, the image
sizes are tensor metadata), so it writes small tables: for each output row and column, the
source pixels it reads and their weights (a separable antialiased filter, torch's and Pillow's:
bilinear or bicubic, its support widened by the downscale), with the flip folded into the
column order. The tables cross to the device in one copy, and the resize is two weighted
gathers, each one ``embedding_bag`` (a gather and a weighted sum in one kernel).

A table's rows are as wide as its widest crop, and its filters as long as its longest, so the
crops are grouped by width and filter length (each rounded up to a power of two; at most eight
groups): one large photo does not pad the whole batch to its size. A group whose float buffers
would pass :data:`CHUNK_BYTES` (64 MiB) is cut into pieces that fit (a piece holds one crop at
least), so that a batch's transient device memory is bounded whatever its size: 256 ImageNet
crops, with four 5-megapixel photos among them, take 0.33 GiB of torch's caching allocator with
their decoded images, the same blocks batch after batch (``tests/test_gpu_paths.py``, on the
model of that allocator). For each piece:

1. its images, packed end to end in one buffer, give the rows the vertical taps read, only
   their crop's columns (one gather), as floats: the table of the vertical pass;
2. vertical pass: each output row of each channel is a weighted sum of source rows;
3. the result is transposed (one copy), so that its columns are rows;
4. horizontal pass: each output column is a weighted sum of those columns;
5. one ``addcmul`` writes the piece's crops into the NCHW batch (through their indices, one
   more copy, unless they are a run of it), converting and normalising per channel
   (``value * scale + offset``: ``ToTensor`` and ``Normalize`` folded together), in the
   output dtype; for a uint8 batch through the piece's floats, rounded into uint8 (one copy).
   After a bicubic filter, which overshoots, the pixels are first clamped to 0–255, as
   Pillow's are.

About ten kernels a piece, however many images it has (an ImageNet batch of 256 makes a dozen
or so); nothing reads a device value back. Each buffer is dropped once used, so a piece's
memory is reused by the next. The same code runs on CPU tensors, which is how its tests see
it. Pixels: torch's antialiased ``interpolate`` of each crop, to float rounding
(``tests/test_gpu_decode.py``); against Pillow's fixed-point resize of a uint8 image, a
fraction of a grey level.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["CHUNK_BYTES", "FIELDS", "UINT8", "PixelAffine", "crop_geometry", "resize_crops"]

# One row of a batch's geometry (float64): the window of the source the output shows (x, y,
# w, h, in source pixels, fractional after a crop of a resized image); the region the resize
# reads, where its taps stop (left, top, right, bottom: the crop a resize follows, or the whole
# image); the output's size; whether it is mirrored; whether the filter is bicubic.
FIELDS = ("x", "y", "w", "h", "left", "top", "right", "bottom", "out_w", "out_h", "flip",
          "bicubic")
_X, _Y, _W, _H, _LEFT, _TOP, _RIGHT, _BOTTOM, _OUT_W, _OUT_H, _FLIP, _BICUBIC = range(12)


def crop_geometry(window: Sequence[float], size: Sequence[int],
                  bounds: Sequence[float] | None = None, flip: bool = False,
                  mode: str = "bilinear") -> np.ndarray:
    """One row of geometry: ``window`` ``(x, y, w, h)`` of the source resized to ``size``
    ``(width, height)``, its taps within ``bounds`` ``(left, top, right, bottom)`` (default:
    the window), mirrored if ``flip``; ``mode`` ``"bilinear"`` or ``"bicubic"``."""
    if mode not in ("bilinear", "bicubic"):
        raise ValueError(f"mode should be 'bilinear' or 'bicubic', got {mode!r}")
    x, y, w, h = window
    left, top, right, bottom = (x, y, x + w, y + h) if bounds is None else bounds
    return np.array([x, y, w, h, left, top, right, bottom, size[0], size[1], flip,
                     mode == "bicubic"], dtype=np.float64)


@dataclass(frozen=True)
class PixelAffine:
    """What the resized pixels (0–255) become: ``value * scale[c] + offset[c]`` in ``dtype``.

    A uint8 ``dtype`` gives the pixels rounded (scale 1, offset 0 only). ``ToTensor`` then
    ``Normalize(mean, std)`` is ``scale = 1 / (255 std)``, ``offset = -mean / std``.
    """

    dtype: torch.dtype = torch.uint8
    scale: tuple[float, float, float] = (1.0, 1.0, 1.0)
    offset: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def __post_init__(self) -> None:
        if self.dtype == torch.uint8 and (self.scale, self.offset) != UINT8_AFFINE:
            raise ValueError("a uint8 output takes the pixels as they are (scale 1, offset 0)")
        if self.dtype != torch.uint8 and not self.dtype.is_floating_point:
            raise ValueError(f"dtype should be uint8 or floating point, got {self.dtype}")


UINT8_AFFINE = ((1.0, 1.0, 1.0), (0.0, 0.0, 0.0))
UINT8 = PixelAffine()


def _filter(distance: np.ndarray, bicubic: np.ndarray) -> np.ndarray:
    """torch's (and Pillow's) antialiasing filters at ``distance`` (``(B, out, K)``, in
    filter units, non-negative): the triangle, or Keys' cubic (a = -0.5) where ``bicubic``."""
    weights = np.maximum(1 - distance, 0)
    if bicubic.any():
        x, a = distance[bicubic], -0.5
        weights[bicubic] = np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                                    np.where(x < 2, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a,
                                             0))
    return weights


def _taps(start: np.ndarray, length: np.ndarray, out: int, low: np.ndarray,
          high: np.ndarray, bicubic: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Source indices ``(B, out, K)`` and weights of one axis: torch's antialiased
    interpolate of the region ``[low, high)`` at the window's sampling positions (Pillow's
    ``resize(box=...)``). Rows have K taps at most; shorter ones are padded with weight 0 on
    their last index, so that indices never decrease along a row."""
    scale = length / out
    stretch = np.maximum(scale, 1.0)
    support = np.where(bicubic, 2.0, 1.0) * stretch
    center = (start - low)[:, None] + (np.arange(out) + 0.5) * scale[:, None]
    first = np.maximum((center - support[:, None] + 0.5).astype(np.int64), 0)
    last = np.maximum(np.minimum((center + support[:, None] + 0.5).astype(np.int64),
                                 (high - low)[:, None]) - 1, first)
    k = np.arange(int((last - first).max()) + 1)
    # Each tap's distance from its centre in filter units; float32 is ample for weights.
    offset = ((first - center + 0.5) / stretch[:, None]).astype(np.float32)
    distance = np.abs(offset[..., None] + (k / stretch[:, None, None]).astype(np.float32))
    weights = _filter(distance, bicubic)
    weights *= k <= (last - first)[..., None]
    total = weights.sum(-1, keepdims=True)
    weights /= np.where(total > 0, total, 1)  # as torch: a window outside its region is 0
    # int32: image coordinates (the packed offsets, in int64, are made from them)
    index = np.minimum((first + low[:, None]).astype(np.int32)[..., None] + k.astype(np.int32),
                       (last + low[:, None]).astype(np.int32)[..., None])
    return index, weights


# Crops whose widths (the columns their taps read) round up to the same power of two, and whose
# filters' lengths do, share a table: padding each to its group's widest and longest costs at
# most about twice the memory and four times the work of no padding, where one table for the
# batch pads every crop to the batch's largest (a 4288-pixel-wide photo: ten times the memory).
# A batch with more classes than this is grouped by width alone, in this many classes.
_MAX_GROUPS = 8


def _power_of_two_class(values: np.ndarray) -> np.ndarray:
    return np.ceil(np.log2(np.maximum(values, 1))).astype(np.int64)


def _groups(widths: np.ndarray, taps_v: np.ndarray, taps_h: np.ndarray) -> list[np.ndarray]:
    """The crops of each group, in batch order: at most :data:`_MAX_GROUPS` groups, the
    widest first (on a GPU, the later groups' buffers can then be cut from its freed
    blocks)."""
    keys = np.stack([_power_of_two_class(a) for a in (widths, taps_v, taps_h)], 1)
    labels = np.unique(keys, axis=0, return_inverse=True)[1].ravel()
    if labels.max() >= _MAX_GROUPS:  # widths up to 64, 128, ..., and the rest
        classes = np.clip(_power_of_two_class(widths), 6, 5 + _MAX_GROUPS)
        labels = np.unique(classes, return_inverse=True)[1].ravel()
    return [np.flatnonzero(labels == label) for label in range(int(labels.max()), -1, -1)]


class _Tables:
    """The host's tables of one group of crops (its taps cut to the group's longest filter)."""

    def __init__(self, geometry: np.ndarray, sizes: np.ndarray, rows: np.ndarray,
                 row_w: np.ndarray, cols: np.ndarray, col_w: np.ndarray) -> None:
        heights, widths = sizes[:, 0], sizes[:, 1]
        self.size = len(geometry)
        # The rows the vertical taps read (indices grow along each axis), each cut to the
        # columns the horizontal taps read.
        first_row, row_count = rows[:, 0, 0], rows[:, -1, -1] + 1 - rows[:, 0, 0]
        first_col = cols[:, 0, 0].copy()  # not a view: the flip below reorders cols
        self.width = int((cols[:, -1, -1] + 1 - first_col).max())
        self.bicubic = bool((geometry[:, _BICUBIC] > 0).any())
        flipped = geometry[:, _FLIP] > 0
        cols[flipped], col_w[flipped] = cols[flipped, ::-1], col_w[flipped, ::-1]

        planes = heights * widths
        image_start = np.cumsum(3 * planes) - 3 * planes
        segment_start = (image_start + first_row * widths + first_col)[:, None] + (
            np.arange(3) * planes[:, None])  # each channel's first row, (B, 3)
        counts = np.repeat(row_count, 3)
        ends = np.cumsum(counts)
        row = np.arange(int(ends[-1])) - np.repeat(ends - counts, counts)
        segments = (np.repeat(segment_start.ravel(), counts)
                    + row * np.repeat(np.repeat(widths, 3), counts))
        table_start = ends[::3] - counts[::3]  # each image's first row in the table
        vertical = (table_start - first_row)[:, None, None] + rows
        channel_rows = np.arange(3) * row_count[:, None]
        horizontal = (np.arange(self.size) * self.width - first_col)[:, None, None] + cols
        largest = max(int(3 * planes.sum()) + self.width, int(horizontal.max()) + 1)
        index = np.int32 if largest < 2**31 else np.int64
        self.taps_v, self.taps_h = rows.shape[-1], cols.shape[-1]
        self.arrays = [segments.astype(index), vertical.astype(index),
                       channel_rows.astype(index), horizontal.astype(index),
                       row_w.astype(np.float32), col_w.astype(np.float32)]


# The float buffers of one piece of a group (its table, the vertical pass and its transpose,
# the resized crops) stay under this, unless one crop alone needs more: the transient device
# memory of a batch is bounded whatever its size, and the same few blocks of the caching
# allocator serve every batch.
CHUNK_BYTES = 64 << 20


def _chunks(group: np.ndarray, row_counts: np.ndarray, width: int,
            out_size: tuple[int, int]) -> list[np.ndarray]:
    """``group`` cut into runs whose float buffers fit :data:`CHUNK_BYTES`, ``width`` being
    the group's (padded) table width."""
    out_h, out_w = out_size
    per_crop = 4 * 3 * (row_counts[group] * width + 2 * out_h * width + out_h * out_w)
    chunks, start, total = [], 0, 0
    for i, nbytes in enumerate(per_crop):
        if i > start and total + nbytes > CHUNK_BYTES:
            chunks.append(group[start:i])
            start, total = i, 0
        total += nbytes
    return [*chunks, group[start:]]


def _batch_tables(geometry: np.ndarray, sizes: np.ndarray
                  ) -> tuple[list[np.ndarray], list[_Tables]]:
    """The batch's pieces (:func:`_groups`, each cut by :func:`_chunks`) and their
    tables."""
    g = geometry
    heights, widths = sizes[:, 0], sizes[:, 1]
    out_h, out_w = int(g[0, _OUT_H]), int(g[0, _OUT_W])
    bicubic = g[:, _BICUBIC] > 0
    # Taps stop at the resized region, and at the image (a window cannot leave it).
    top = np.clip(np.round(g[:, _TOP]), 0, heights - 1).astype(np.int64)
    bottom = np.clip(np.round(g[:, _BOTTOM]), top + 1, heights).astype(np.int64)
    left = np.clip(np.round(g[:, _LEFT]), 0, widths - 1).astype(np.int64)
    right = np.clip(np.round(g[:, _RIGHT]), left + 1, widths).astype(np.int64)
    rows, row_w = _taps(g[:, _Y], g[:, _H], out_h, top, bottom, bicubic)
    cols, col_w = _taps(g[:, _X], g[:, _W], out_w, left, right, bicubic)
    # Each crop's own filter length (its longest row of taps) and the columns it reads
    taps_v = (rows[..., -1] - rows[..., 0]).max(1) + 1
    taps_h = (cols[..., -1] - cols[..., 0]).max(1) + 1
    widths = cols[:, -1, -1] + 1 - cols[:, 0, 0]
    row_counts = rows[:, -1, -1] + 1 - rows[:, 0, 0]
    pieces = [chunk for group in _groups(widths, taps_v, taps_h)
              for chunk in _chunks(group, row_counts, 2 ** int(_power_of_two_class(
                  widths[group]).max()), (out_h, out_w))]
    tables = []
    for i in pieces:  # the taps past a piece's longest filter all have weight 0
        v, h = taps_v[i].max(), taps_h[i].max()
        tables.append(_Tables(g[i], sizes[i], rows[i, :, :v], row_w[i, :, :v], cols[i, :, :h],
                              col_w[i, :, :h]))
    return pieces, tables


_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
                 np.dtype(np.float32): torch.float32}


def _upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """``arrays`` on ``device``, in one copy (from page-locked memory when it is a GPU)."""
    bounds = np.cumsum([0, *(-(-a.nbytes // 8) * 8 for a in arrays)])  # 8-byte aligned
    host = torch.empty(int(bounds[-1]), dtype=torch.uint8, pin_memory=device.type == "cuda")
    packed = host.numpy()
    for array, start in zip(arrays, bounds, strict=False):
        packed[start:start + array.nbytes] = np.ascontiguousarray(array).view(np.uint8).ravel()
    on_device = host.to(device, non_blocking=True)
    return [on_device[start:start + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
            for a, start in zip(arrays, bounds, strict=False)]


def _resize_group(images: list[torch.Tensor], tables: _Tables, arrays: list[torch.Tensor],
                  out_size: tuple[int, int]) -> torch.Tensor:
    """One group's crops resized: ``(n, out_w, 3, out_h)`` floats, 0–255. Each buffer is
    dropped after its last use: on the same stream, the next allocation may take it at once."""
    segments, vertical, channel_rows, horizontal, row_w, col_w = arrays
    n, (out_h, out_w), width = tables.size, out_size, tables.width
    taps_v, taps_h = tables.taps_v, tables.taps_h
    # The images end to end, then room for the last segment to run past its image: those
    # columns are never read (their weights are zero), so the room is left uninitialised.
    device = images[0].device
    packed = torch.cat([*(image.reshape(-1) for image in images),
                        torch.empty(width, dtype=torch.uint8, device=device)])
    table = packed.unfold(0, width, 1)[segments].float()
    del packed
    rows = (vertical.view(n, 1, out_h, taps_v) + channel_rows.view(n, 3, 1, 1)).view(-1, taps_v)
    row_weights = row_w.view(n, 1, out_h, taps_v).expand(n, 3, out_h, taps_v)
    vertical_pass = F.embedding_bag(rows, table, per_sample_weights=row_weights.reshape(
        -1, taps_v), mode="sum")
    del table, rows, row_weights
    columns = vertical_pass.view(n, 3 * out_h, width).transpose(1, 2).reshape(
        n * width, 3 * out_h)
    del vertical_pass
    resized = F.embedding_bag(horizontal.view(-1, taps_h), columns,
                              per_sample_weights=col_w.view(-1, taps_h), mode="sum")
    del columns
    if tables.bicubic:  # the cubic filter overshoots: Pillow's uint8 result is clamped
        resized.clamp_(0, 255)
    return resized.view(n, out_w, 3, out_h)


def resize_crops(images: Sequence[torch.Tensor], geometry: np.ndarray,
                 affine: PixelAffine = UINT8) -> torch.Tensor:
    """Crop, resize, flip and convert a batch: ``images`` (uint8 ``3×H×W``, of any sizes, on
    one device) with one row of ``geometry`` each (:func:`crop_geometry`; every row with the
    same output size) to an ``N×3×out_h×out_w`` tensor of ``affine.dtype``.

    Queues a fixed number of kernels per piece of crops of similar width and filter length
    (at most eight groups, cut into pieces of bounded memory), whatever the batch size (for
    contiguous images, as decoders give them; any other is copied first), and waits for none
    of them.
    """
    if len(images) != len(geometry) or not len(images):
        raise ValueError(f"{len(images)} images for {len(geometry)} rows of geometry")
    if len(np.unique(geometry[:, [_OUT_W, _OUT_H]], axis=0)) != 1:
        raise RuntimeError("stack expects each tensor to be equal size, but the crops of this "
                           f"batch have sizes {np.unique(geometry[:, [_OUT_W, _OUT_H]], axis=0)}")
    device = images[0].device
    out_h, out_w = int(geometry[0, _OUT_H]), int(geometry[0, _OUT_W])
    groups, tables = _batch_tables(geometry, np.array([image.shape[1:] for image in images]))
    # A group that is not a run of the batch is written through its indices.
    scattered = [i for i, group in enumerate(groups) if group[-1] - group[0] + 1 != len(group)]
    offset = [0.5 if affine.dtype == torch.uint8 else b for b in affine.offset]
    arrays = _upload([*(a for t in tables for a in t.arrays),
                      *(groups[i].astype(np.int64) for i in scattered),
                      np.array(affine.scale, np.float32), np.array(offset, np.float32)], device)
    scale, shift = arrays[-2].view(1, 3, 1, 1), arrays[-1].view(1, 3, 1, 1)
    indices = dict(zip(scattered, arrays[6 * len(tables):], strict=False))
    floats = affine.dtype if affine.dtype != torch.uint8 else torch.float32
    out = torch.empty((len(images), 3, out_h, out_w), dtype=affine.dtype, device=device)
    for i, (group, table) in enumerate(zip(groups, tables, strict=True)):
        resized = _resize_group([images[j] for j in group], table, arrays[6 * i:6 * i + 6],
                                (out_h, out_w))
        pixels = resized.permute(0, 2, 3, 1)
        run = out[int(group[0]):int(group[-1]) + 1]
        # floats straight into the batch where they can; uint8 through a piece of floats,
        # whose conversion's truncation rounds (the offset was 0.5)
        direct = i not in indices and out.dtype == floats
        values = run if direct else torch.empty(pixels.shape, dtype=floats, device=device)
        torch.addcmul(shift, pixels, scale, out=values)
        del resized, pixels
        if i in indices:
            converted = values if out.dtype == floats else torch.empty(
                values.shape, dtype=out.dtype, device=device).copy_(values)
            out.index_copy_(0, indices[i], converted)
            del converted
        elif not direct:
            run.copy_(values)
        del run, values
    return out
