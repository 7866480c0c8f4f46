"""Batches as ``augment_device``'s workers record them (:mod:`fastfeed.ultralytics.gpu_augment`),
for the pixel-op tests."""

import numpy as np
import torch

from fastfeed.ultralytics.gpu_augment import (
    FLIP_LR_FLAG,
    FLIP_UD_FLAG,
    HSV_FLAG,
    LUT_KEY,
    PARAM_COLUMNS,
    PARAMS_KEY,
    REGION_KEY,
    REVERSE_FLAG,
    SIZE_KEY,
)

# The flag columns, in the order of the bits of ``params``'s ``flags``.
FLAG_COLUMNS = (HSV_FLAG, REVERSE_FLAG, FLIP_LR_FLAG, FLIP_UD_FLAG)


def params(matrices, flags) -> torch.Tensor:
    """Each image's recorded parameters: its warp matrix's top two rows, and its flags as the
    bits of ``flags[i]`` (bit 0: HSV, 1: reverse the channels, 2: flip left-right, 3: up-down).
    """
    matrices = np.asarray(matrices, dtype=np.float64)
    out = torch.zeros(len(matrices), PARAM_COLUMNS, dtype=torch.float64)
    out[:, :6] = torch.from_numpy(matrices[:, :2].reshape(len(matrices), 6))
    for bit, column in enumerate(FLAG_COLUMNS):
        out[:, column] = torch.tensor([(f >> bit) & 1 for f in flags], dtype=torch.float64)
    return out


def recorded(img, params, luts, regions, size) -> dict:
    """A sample or a batch under the keys the pixel ops read."""
    return {"img": img, PARAMS_KEY: params, LUT_KEY: luts, REGION_KEY: regions, SIZE_KEY: size}
