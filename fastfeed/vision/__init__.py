"""Image pipelines: ``accelerate`` for torchvision datasets, ImageFolder and YOLO datasets,
window decoding, and ``image_loader``.

Example:
    >>> from fastfeed.vision import image_loader
    >>> loader = image_loader("imagenet/train", batch_size=256, device="cuda")
    >>> for images, targets in loader:  # uint8 N×3×224×224 on the GPU
    ...     ...
"""

from fastfeed.vision.accelerate import accelerate, batch_tail
from fastfeed.vision.folder import ImageFolder
from fastfeed.vision.folder_loader import image_loader
from fastfeed.vision.image_collate import ImageCollate, YoloCollate
from fastfeed.vision.window_decode import DecodeError, decode_resized_crop, roi_decoder_available
from fastfeed.vision.yolo import YoloDataset, parse_labels

__all__ = [
    "DecodeError",
    "ImageCollate",
    "ImageFolder",
    "YoloCollate",
    "YoloDataset",
    "accelerate",
    "batch_tail",
    "decode_resized_crop",
    "image_loader",
    "parse_labels",
    "roi_decoder_available",
]
