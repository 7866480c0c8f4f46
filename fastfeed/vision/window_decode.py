"""Decode JPEGs as little as possible: only the crop window, at the coarsest DCT scale.

Two paths, giving the same pixels up to the rounding of window edges:

- ``fastfeed._jpeg.decode_crop`` (libjpeg-turbo, when that extension was built): decodes
  only the rows and iMCU columns of the window, at 1/2, 1/4 or 1/8 scale when the window is
  at least 2×, 4× or 8× the output.
- Pillow: ``Image.draft`` picks the DCT scale for the whole image (it only pays when the window
  is at least twice the output), then the window is cut out.

Either way the window is resized with torch's uint8 antialiased kernel (bilinear, or bicubic
on request).

Anything that is not a JPEG (PNG, WebP, ...) goes through Pillow.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageFile

from fastfeed.vision.libjpeg import window_decoder

# None where it was not built, or was built for another libjpeg: Pillow decodes.
_jpeg = window_decoder()

__all__ = ["Box", "DecodeError", "decode_resized_crop", "image_size", "jpeg_frame_size",
           "roi_decoder_available"]

Box = tuple[int, int, int, int]  # x, y, width, height in source pixels

_JPEG_MAGIC = b"\xff\xd8"
# Start-of-frame markers: SOF0-3, 5-7, 9-11 and 13-15 (C4 is DHT, C8 reserved, CC DAC).
FRAME_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers without a length field: TEM, the restart markers RST0-7, and a stuffed zero.
_BARE_MARKERS = frozenset((0x00, 0x01, *range(0xD0, 0xD8)))
_SCAN, _END = 0xDA, 0xD9


class DecodeError(OSError):
    """An image file that cannot be decoded; the message names the file."""


def roi_decoder_available() -> bool:
    """Whether the libjpeg-turbo window decoder (``fastfeed._jpeg``) was built, for the libjpeg
    it runs against."""
    return _jpeg is not None


def _is_jpeg(data: bytes) -> bool:
    return data[:2] == _JPEG_MAGIC


def jpeg_ends(data: bytes) -> bool:
    """Whether ``data`` is a JPEG that ends: its end-of-image marker, before any zero
    padding (a truncated file has none)."""
    return _is_jpeg(data) and data[-64:].rstrip(b"\x00").endswith(b"\xff\xd9")


def _window_decodable(data: bytes) -> bool:
    """Whether the window decoder may take ``data``: a JPEG that ends, and Pillow not told to
    load truncated images. The window decoder never reads the rows below the window, so it
    would load a truncated file that Pillow (and torchvision) refuse, or refuse one Pillow is
    told to load."""
    return jpeg_ends(data) and not ImageFile.LOAD_TRUNCATED_IMAGES


def jpeg_frame_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` of a JPEG from its frame header, as libjpeg reports it for any file
    it decodes (before any EXIF rotation): the segments before it are skipped by their lengths,
    and bytes between segments as libjpeg skips them. A few microseconds, where libjpeg's header
    read parses every table on the way (about 25). Tables are not checked: a file whose frame
    type or tables libjpeg refuses gets a size here and fails at its decode.

    Raises:
        ValueError: not a JPEG, a scan or the end before any frame, a frame without a size, or
            the data ends first.
    """
    if not _is_jpeg(data):
        raise ValueError("not a JPEG file (no start-of-image marker)")
    at, end = 2, len(data)
    while (at := data.find(0xFF, at)) >= 0:
        while at < end and data[at] == 0xFF:  # fill bytes
            at += 1
        if at + 3 > end:
            break
        marker, length = data[at], int.from_bytes(data[at + 1:at + 3], "big")
        if marker in _BARE_MARKERS:
            at += 1
        elif marker in FRAME_MARKERS:
            if at + 8 > end:
                break
            height = int.from_bytes(data[at + 4:at + 6], "big")
            width = int.from_bytes(data[at + 6:at + 8], "big")
            if not (height and width):
                raise ValueError(f"the frame header gives an empty image ({width}x{height})")
            return width, height
        elif marker in (_SCAN, _END):
            raise ValueError("no frame header before the image data")
        else:
            at += 1 + length
    raise ValueError("the file ends before its frame header")


def image_size(data: bytes, path: str | Path = "<bytes>") -> tuple[int, int]:
    """``(width, height)`` from the header, without decoding pixels."""
    try:
        if _is_jpeg(data):
            return jpeg_frame_size(data)
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except Exception as error:
        raise DecodeError(f"cannot read image {path}: {error}") from error


def decode_resized_crop(
    data: bytes,
    choose_box: Callable[[int, int], Box],
    size: tuple[int, int],
    path: str | Path = "<bytes>",
    use_roi: bool = True,
    mode: str = "bilinear",
    dct_margin: int = 1,
    channels_last: bool = False,
) -> torch.Tensor:
    """Decode the box ``choose_box(width, height)`` of an image, resized to ``size``.

    Args:
        data: the encoded file.
        choose_box: given the image size, returns the crop box (x, y, w, h).
        size: output ``(width, height)``.
        path: named in errors.
        use_roi: allow the libjpeg-turbo window decoder (else Pillow only).
        mode: ``"bilinear"`` or ``"bicubic"`` (antialiased either way, as Pillow resizes).
        dct_margin: a JPEG is decoded at the coarsest DCT scale that keeps the window at least
            ``dct_margin`` times ``size``: larger is closer to a full decode, and slower on
            large images.
        channels_last: return the image in ``H×W×C`` memory, as the resize writes it (a
            contiguous ``C×H×W`` copy costs a third of the resize).

    Returns:
        uint8 tensor of shape ``(3, height, width)``, RGB.
    """
    box: Box | None = None

    def chosen(width: int, height: int) -> Box:
        # Chosen once (it may draw random numbers), whichever decoder ends up using it.
        nonlocal box
        if box is None:
            box = choose_box(width, height)
        return box

    try:
        if use_roi and _window_decodable(data) and roi_decoder_available():
            x, y, w, h = chosen(*jpeg_frame_size(data))
            try:
                window, _ = _jpeg.decode_crop(data, x, y, w, h, dct_margin * size[0],
                                              dct_margin * size[1])
                return resize(window, size, mode, channels_last)
            except Exception:
                pass  # CMYK or YCCK (Pillow converts them, as torchvision does), or broken
        return _pillow_resized_crop(data, chosen, size, mode, dct_margin, channels_last)
    except DecodeError:
        raise
    except Exception as error:
        raise DecodeError(f"cannot decode image {path}: {error}") from error


def resize(image: np.ndarray, size: tuple[int, int], mode: str = "bilinear",
           channels_last: bool = False) -> torch.Tensor:
    """Antialiased resize (``mode``: bilinear or bicubic) of a uint8 HWC image to a uint8 CHW
    tensor of ``size`` (width, height); with ``channels_last``, in ``H×W×C`` memory.

    torch's uint8 kernels give Pillow's BILINEAR and BICUBIC results (to within rounding) about
    three times faster; they run in the calling thread's torch threads (one, in a worker).
    Their own layout is ``H×W×C``: a contiguous ``C×H×W`` output is a transposing copy of it.
    """
    hwc = torch.from_numpy(np.ascontiguousarray(image))
    width, height = size
    if (image.shape[1], image.shape[0]) == size:
        return hwc.permute(2, 0, 1) if channels_last else hwc.permute(2, 0, 1).contiguous()
    chw = hwc.permute(2, 0, 1).unsqueeze(0)
    if not channels_last:
        return torch.nn.functional.interpolate(chw, size=(height, width), mode=mode,
                                               antialias=True, align_corners=False)[0]
    out = torch.empty((1, height, width, image.shape[2]), dtype=torch.uint8).permute(0, 3, 1, 2)
    # interpolate's own op, which takes the output's layout from ``out``
    aa = (torch._C._nn._upsample_bilinear2d_aa if mode == "bilinear"
          else torch._C._nn._upsample_bicubic2d_aa)
    aa(chw, (height, width), False, out=out)  # type: ignore[call-arg]
    return out[0]


def _pillow_resized_crop(data: bytes, choose_box: Callable[[int, int], Box],
                         size: tuple[int, int], mode: str, dct_margin: int,
                         channels_last: bool) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        x, y, w, h = choose_box(width, height)
        if image.format == "JPEG":
            # The largest DCT reduction that keeps the *window* at dct_margin x ``size``.
            image.draft("RGB", (max(1, width * dct_margin * size[0] // w),
                                max(1, height * dct_margin * size[1] // h)))
        scale_x, scale_y = image.size[0] / width, image.size[1] / height
        rgb = np.array(image.convert("RGB"))  # writable: torch.from_numpy warns otherwise
    left, top = int(x * scale_x), int(y * scale_y)
    right = max(left + 1, round((x + w) * scale_x))
    bottom = max(top + 1, round((y + h) * scale_y))
    return resize(rgb[top:bottom, left:right], size, mode, channels_last)
