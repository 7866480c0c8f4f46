"""Collates for image datasets: the images of a batch become one NCHW uint8 tensor.

Images may be CHW tensors (fastfeed's datasets) or HWC numpy arrays (OpenCV-style datasets);
the C++ gather copies them, transposing HWC to CHW in the same pass. Both collates are
*slot-aware*: in a FastLoader worker, ``collate_into(samples, empty)`` gets an allocator that
returns memory in the pool slot, so the batch is written there directly. Called plainly
(``collate(samples)``), for example by torch's DataLoader, they allocate ordinary tensors and
give the same result.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fastfeed.collate import Empty, gather_images, torch_empty

__all__ = ["ImageCollate", "YoloCollate"]


class ImageCollate:
    """``[(image, target), ...]`` -> ``(uint8 N×C×H×W, int64 targets)``; images CHW tensors
    or HWC numpy arrays."""

    def collate_into(self, samples: list[Any], empty: Empty) -> tuple[torch.Tensor, torch.Tensor]:
        images = gather_images([image for image, _ in samples], empty)
        targets = empty((len(samples),), torch.int64)
        targets.copy_(torch.as_tensor([target for _, target in samples], dtype=torch.int64))
        return images, targets

    def __call__(self, samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.collate_into(samples, torch_empty)


class YoloCollate:
    """YoloDataset items -> Ultralytics' batch: ``img`` uint8 N×3×S×S, ``cls`` (M, 1),
    ``bboxes`` (M, 4), ``batch_idx`` (M,), ``im_file`` and ``ori_shape`` lists."""

    def collate_into(self, samples: list[dict], empty: Empty) -> dict[str, Any]:
        counts = [len(s["cls"]) for s in samples]
        return {
            "img": gather_images([s["img"] for s in samples], empty),
            "cls": torch.from_numpy(np.concatenate([s["cls"] for s in samples]).reshape(-1, 1)),
            "bboxes": torch.from_numpy(
                np.concatenate([s["bboxes"] for s in samples]).reshape(-1, 4)),
            "batch_idx": torch.repeat_interleave(
                torch.arange(len(samples), dtype=torch.float32), torch.tensor(counts)),
            "im_file": [s["im_file"] for s in samples],
            "ori_shape": [s["ori_shape"] for s in samples],
        }

    def __call__(self, samples: list[dict]) -> dict[str, Any]:
        return self.collate_into(samples, torch_empty)
