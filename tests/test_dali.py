"""The DALI backend in CPU-only mode (installed through the ``dali`` extra)."""

import math

import pytest
import torch

from fastfeed.vision import ImageFolder, image_loader
from fastfeed.vision.synthetic import make_imagefolder

pytest.importorskip("nvidia.dali",
                    reason="NVIDIA DALI is not installed (pip install 'fastfeed[dali]')")

from fastfeed.vision.dali import DaliLoader


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("dali"), images=45, classes=3)


def test_eval_batches_match_the_cpu_backend(folder):
    loader = DaliLoader(folder, batch_size=8, size=64, train=False)
    reference = ImageFolder(folder, size=64, train=False)
    seen = 0
    for images, targets in loader:
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, 64, 64)
        for image, target in zip(images, targets.tolist(), strict=True):
            want, want_target = reference[seen]
            assert target == want_target
            diff = (image.int() - want.int()).abs().float().mean()
            assert diff < 6.0, (seen, diff)
            seen += 1
    assert seen == len(reference)


@pytest.mark.parametrize("drop_last", [False, True])
def test_epochs_len_and_last_batch(folder, drop_last):
    loader = DaliLoader(folder, batch_size=8, size=32, train=True, drop_last=drop_last)
    expected = 45 // 8 if drop_last else math.ceil(45 / 8)
    assert len(loader) == expected
    for _ in range(2):
        sizes = [len(targets) for _, targets in loader]
        assert len(sizes) == expected
        assert sizes[-1] == (8 if drop_last else 45 % 8)


def test_image_loader_picks_dali(folder):
    loader = image_loader(folder, batch_size=8, size=32, backend="dali")
    images, targets = next(iter(loader))
    assert images.shape == (8, 3, 32, 32) and targets.dtype == torch.int64
