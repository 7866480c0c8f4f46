"""The ``"nvjpeg"`` backend: workers read file bytes; the GPU decodes, crops and resizes.

Workers parse only the JPEG header (to draw the crop box from the image size) and hand over
the encoded bytes and the box (:class:`~fastfeed.vision.gpu_decode.EncodedCrop`); on the copy
stream, :class:`~fastfeed.vision.gpu_decode.DecodeCrops` decodes the whole batch with
TorchCodec's or torchvision's ``decode_jpeg(device="cuda")``
(:mod:`fastfeed.vision.jpeg_decoders`) and crops, resizes and flips it in about ten kernels per
piece of similar crops (:mod:`fastfeed.vision.gpu_decode` has the stream rules). The decoder's
library is imported only there, and only when this backend is used. A file nvJPEG cannot
take (not a JPEG, though named ``.JPEG``: ImageNet has a PNG; a CMYK, 12-bit,
arithmetic-coded, truncated, unusually subsampled or EXIF-rotated JPEG) is decoded by its
worker on the CPU,
as :class:`~fastfeed.vision.ImageFolder` decodes it, so ``on_error`` applies to it alike. A
file that passes those checks and that nvJPEG still refuses is decoded on the host once its
batch reaches the GPU; ``on_error`` cannot apply there (the batch is collated): one that the
CPU cannot decode either raises, naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastfeed.skip import SKIP
from fastfeed.transforms import Compose
from fastfeed.vision.augment import random_flip
from fastfeed.vision.folder import ImageFolder
from fastfeed.vision.gpu_decode import (
    DecodeCrops,
    EncodedCrop,
    encoded_collate,
    gpu_decodable,
)
from fastfeed.vision.resample import FIELDS, crop_geometry
from fastfeed.vision.window_decode import DecodeError, decode_resized_crop, image_size

__all__ = ["EncodedImageFolder", "encoded_collate", "nvjpeg_transform"]

_FLIP = FIELDS.index("flip")


class EncodedImageFolder(ImageFolder):
    """An :class:`ImageFolder` whose items are ``(EncodedCrop, target)``, collated by
    :func:`~fastfeed.vision.gpu_decode.encoded_collate`: the file's bytes and the crop to make
    of it, for the GPU; for a file nvJPEG cannot take (see
    :func:`~fastfeed.vision.gpu_decode.gpu_decodable`), the crop decoded here (uint8
    ``3×size×size``), with the same random draws. A file the worker cannot read or decode is
    handled as ``on_error`` says (one that only nvJPEG refuses: see the module's notes).
    """

    def __getitem__(self, index: int) -> Any:
        path, target = self.samples[index]
        size = (self.size, self.size)
        try:
            with open(path, "rb") as f:
                data = f.read()
            if gpu_decodable(data):
                box = self._box(*image_size(data, path))
                crop = EncodedCrop.encoded(data, crop_geometry(box, size), str(path))
            else:
                crop = EncodedCrop.decoded(
                    decode_resized_crop(data, self._box, size, path, self.roi_decode))
        except DecodeError:
            if self.on_error == "skip":
                return SKIP
            raise
        crop.geometry[_FLIP] = self.train and random_flip()  # either way, on the GPU
        return crop, target


class _DecodeThen(Compose):
    """The decode followed by the user's ``gpu_transform``."""

    blocks_host = True


def nvjpeg_transform(then: Callable[[Any], Any] | None = None) -> Callable[[Any], Any]:
    """The backend's ``gpu_transform``: the decode, then ``then`` if given."""
    decode = DecodeCrops()
    return decode if then is None else _DecodeThen([decode, then])
