"""``accelerate`` on timm's transforms and the recipes of ``benchmarks/recipes_pipeline.py``,
side by side with the stock pipeline.

Needs torchvision and timm (the client environment).
"""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from clients import import_or_skip

pytestmark = pytest.mark.clients
import_or_skip("torchvision", "timm.data")
from timm.data import create_transform  # noqa: E402
from timm.data.transforms import RandomResizedCropAndInterpolation  # noqa: E402
from timm.data.transforms import ToNumpy as TimmToNumpy  # noqa: E402
from timm.data.transforms import ToTensor as TimmToTensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchvision import datasets  # noqa: E402
from torchvision import transforms as T  # noqa: E402

from fastfeed import FastLoader  # noqa: E402
from fastfeed.vision.accelerate import FusedTransform, accelerate  # noqa: E402
from fastfeed.vision.synthetic import make_imagefolder  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # whichever way pytest runs
from benchmarks.recipes_pipeline import RECIPES  # noqa: E402
from tests.test_accelerate import STD, Recorder, assert_same_as_stock  # noqa: E402

TIMM = {
    "timm-random-interpolation": lambda: create_transform(
        160, is_training=True, interpolation="random"),
    "timm-bicubic": lambda: create_transform(160, is_training=True, interpolation="bicubic",
                                             color_jitter=None),
    "timm-eval": lambda: create_transform(224),
    "timm-prefetcher": lambda: create_transform(160, is_training=True, use_prefetcher=True),
    "timm-to-numpy": lambda: T.Compose([RandomResizedCropAndInterpolation(96), TimmToNumpy()]),
    "timm-to-tensor": lambda: T.Compose([RandomResizedCropAndInterpolation(96),
                                         T.RandomHorizontalFlip(), TimmToTensor()]),
}
PIPELINES = {**RECIPES, **TIMM}
# RandAugment quantises (posterize, solarize, equalize): a fraction of a grey level in its
# input can move a pixel by many. The draws must still be the same.
GREY_LEVELS = {"timm-ra": 8.0}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("recipes"), images=16, classes=4)


class TimmRecorder(Recorder):
    """Also records the windows timm's RandomResizedCropAndInterpolation draws."""

    def __init__(self, monkeypatch):
        super().__init__(monkeypatch)
        timm_get_params = RandomResizedCropAndInterpolation.get_params

        def get_params(img, scale, ratio):
            self.calls.append(timm_get_params(img, scale, ratio))
            return self.calls[-1]

        monkeypatch.setattr(RandomResizedCropAndInterpolation, "get_params",
                            staticmethod(get_params))


@pytest.mark.parametrize("name", PIPELINES)
def test_same_draws_labels_and_close_pixels(name, root, monkeypatch):
    stock = datasets.ImageFolder(str(root), transform=PIPELINES[name]())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast = accelerate(stock)
    assert isinstance(fast.transform, FusedTransform)
    assert fast.transform.plan.geometry, "the crop runs the fast way"
    assert_same_as_stock(stock, fast, TimmRecorder(monkeypatch), GREY_LEVELS.get(name, 2.0))


@pytest.mark.parametrize("name", RECIPES)
def test_batches_match_torch_dataloader_side_by_side(name, root):
    """The recipes of the benchmark, each loader with 2 workers seeding torch, Python and
    numpy: the same labels, order, shapes and dtypes; pixels close."""
    stock = datasets.ImageFolder(str(root), transform=PIPELINES[name]())
    kwargs = {"batch_size": 4, "shuffle": True, "num_workers": 2}
    expected = DataLoader(stock, generator=torch.Generator().manual_seed(7), **kwargs)
    got = FastLoader(accelerate(stock), generator=torch.Generator().manual_seed(7), **kwargs)
    pairs = list(zip(expected, got, strict=True))
    assert len(pairs) == len(expected)
    for (images, targets), (fast_images, fast_targets) in pairs:
        assert torch.equal(targets, fast_targets)
        assert fast_images.shape == images.shape and fast_images.dtype == images.dtype
        grey = float(((images - fast_images) * torch.tensor(STD).view(1, 3, 1, 1) * 255)
                     .abs().mean())
        assert grey <= GREY_LEVELS.get(name, 2.0)


def test_the_benchmark_runs(root):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "recipes_pipeline.py"
    out = subprocess.run([sys.executable, str(script), "--data", str(root), "--configs",
                          "timm-ra/stock,timm-ra/accelerate", "--repeats", "1", "--epochs", "1",
                          "--batch-size", "8", "--workers", "1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| timm-ra | stock |" in out.stdout and "| timm-ra | accelerate |" in out.stdout
