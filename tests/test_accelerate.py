"""``fastfeed.vision.accelerate`` against the user's own torchvision pipeline, side by side.

Needs torchvision (the ``torchvision`` extra; CI runs this file in its client environment).
"""

import io
import json
import pickle
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.clients
try:
    import torchvision  # noqa: F401
except Exception as error:  # missing, or built for another torch (a RuntimeError)
    pytest.skip(f"needs torchvision: {error}", allow_module_level=True)
from PIL import Image  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchvision import datasets  # noqa: E402
from torchvision import transforms as T  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

from fastfeed import FastLoader  # noqa: E402
from fastfeed.vision import ImageFolder as FastImageFolder  # noqa: E402
from fastfeed.vision.accelerate import FusedTransform, accelerate, batch_tail  # noqa: E402
from fastfeed.vision.synthetic import make_image, make_imagefolder  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]

PIPELINES = {
    "v1-train": lambda: T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(),
                                   T.ToTensor(), T.Normalize(MEAN, STD)]),
    "v1-eval": lambda: T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(),
                                  T.Normalize(MEAN, STD)]),
    "v1-uint8": lambda: T.Compose([T.Resize((200, 150)), T.RandomHorizontalFlip(0.7),
                                   T.PILToTensor(), T.ConvertImageDtype(torch.float32)]),
    "v1-nested": lambda: T.Compose([T.Compose([T.RandomResizedCrop(96, scale=(0.5, 1.0))]),
                                    T.RandomHorizontalFlip(), T.PILToTensor()]),
    "v1-single": lambda: T.ToTensor(),
    "v2-train": lambda: v2.Compose([v2.ToImage(), v2.RandomResizedCrop(224),
                                    v2.RandomHorizontalFlip(),
                                    v2.ToDtype(torch.float32, scale=True),
                                    v2.Normalize(MEAN, STD)]),
    "v2-eval": lambda: v2.Compose([v2.Resize(256), v2.CenterCrop(224), v2.PILToTensor(),
                                   v2.ToDtype(torch.float32, scale=True),
                                   v2.Normalize(MEAN, STD)]),
    "v2-crop-after-flip": lambda: v2.Compose([v2.RandomHorizontalFlip(), v2.CenterCrop(100),
                                              v2.RandomResizedCrop(64), v2.ToImage()]),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = make_imagefolder(tmp_path_factory.mktemp("tv"), images=18, classes=3)
    # A PNG and a grey JPEG: both must still match the stock pipeline.
    rng = random.Random(5)
    make_image(rng, 300, 220).save(root / "class_001" / "extra.png")
    make_image(rng, 260, 300).convert("L").save(root / "class_002" / "grey.jpg", quality=90)
    return root


def grey_levels(stock, fast, transform):
    """Mean |Δ| in 0–255 grey levels, with Normalize undone."""
    a, b = stock.float(), fast.float()
    if stock.is_floating_point():
        a, b = a * 255, b * 255
        if "Normalize" in repr(transform):
            std = torch.tensor(STD).view(3, 1, 1)
            a, b = a * std, b * std
    return float((a - b).abs().mean())


class Recorder:
    """Records the crop windows torchvision draws, on whichever side calls it."""

    def __init__(self, monkeypatch):
        self.calls = []
        v1_get_params = T.RandomResizedCrop.get_params
        v2_make_params = v2.RandomResizedCrop.make_params

        def get_params(img, scale, ratio):
            self.calls.append(v1_get_params(img, scale, ratio))
            return self.calls[-1]

        def make_params(transform, flat_inputs):
            params = v2_make_params(transform, flat_inputs)
            self.calls.append(tuple(params.values()))
            return params

        monkeypatch.setattr(T.RandomResizedCrop, "get_params", staticmethod(get_params))
        monkeypatch.setattr(v2.RandomResizedCrop, "make_params", make_params)

    def take(self):
        calls, self.calls = self.calls, []
        return calls


@pytest.mark.parametrize("name", PIPELINES)
def test_same_draws_labels_and_close_pixels(name, root, monkeypatch):
    transform = PIPELINES[name]()
    stock = datasets.ImageFolder(str(root), transform=transform)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast = accelerate(stock)
    assert isinstance(fast.transform, FusedTransform)
    recorder = Recorder(monkeypatch)
    for index in range(len(stock)):
        torch.manual_seed(index)
        image, target = stock[index]
        stock_draws, stock_rng = recorder.take(), torch.get_rng_state()
        torch.manual_seed(index)
        fast_image, fast_target = fast[index]
        assert recorder.take() == stock_draws
        assert torch.equal(torch.get_rng_state(), stock_rng), "a different number of draws"
        assert fast_target == target
        assert type(fast_image) is type(image)
        assert fast_image.dtype == image.dtype and fast_image.shape == image.shape
        assert fast_image.is_contiguous()
        assert grey_levels(image, fast_image, transform) <= 2.0, stock.samples[index][0]


def test_flip_is_the_same_draw(root):
    """With p=1 and p=0 the flip decides nothing; with p=0.5 it must mirror stock's choice,
    which an asymmetric crop shows: the unflipped image is far from the flipped one."""
    transform = T.Compose([T.CenterCrop(160), T.RandomHorizontalFlip(), T.PILToTensor()])
    stock = datasets.ImageFolder(str(root), transform=transform)
    fast = accelerate(stock)
    for seed in range(12):
        torch.manual_seed(seed)
        image, _ = stock[0]
        torch.manual_seed(seed)
        fast_image, _ = fast[0]
        same = grey_levels(image, fast_image, transform)
        mirrored = grey_levels(image, fast_image.flip(-1), transform)
        assert same <= 2.0 < mirrored


def times_ten(target):
    return target * 10


def test_keeps_the_users_dataset(root):
    stock = datasets.ImageFolder(str(root), transform=PIPELINES["v1-train"](),
                                 target_transform=times_ten)
    fast = accelerate(stock)
    assert type(fast) is type(stock) and fast is not stock
    assert fast.classes == stock.classes and fast.class_to_idx == stock.class_to_idx
    assert fast.samples == stock.samples and fast.targets == stock.targets
    assert len(fast) == len(stock) and fast.root == stock.root
    assert fast.target_transform is stock.target_transform
    last = len(stock) - 1
    assert [fast[i][1] for i in (0, last)] == [stock[i][1] for i in (0, last)] == [0, 20]
    assert isinstance(stock.transform, T.Compose), "the user's dataset is left as it was"
    assert "RandomResizedCrop" in repr(fast.transform)
    assert pickle.loads(pickle.dumps(fast)).samples == stock.samples


def test_fastfeed_imagefolder_is_returned_as_is(root):
    dataset = FastImageFolder(root)
    assert accelerate(dataset) is dataset


class OwnGetItem(datasets.ImageFolder):
    def __getitem__(self, index):
        return super().__getitem__(index)


@pytest.mark.parametrize(("make", "named"), [
    (lambda r: datasets.ImageFolder(r, transform=T.Compose([
        T.RandomResizedCrop(64), T.ColorJitter(0.4), T.ToTensor()])), "ColorJitter"),
    (lambda r: datasets.ImageFolder(r, transform=T.Compose([
        T.Lambda(lambda x: x), T.ToTensor()])), "Lambda"),
    (lambda r: datasets.ImageFolder(r, transform=T.Compose([
        T.Resize(64, interpolation=T.InterpolationMode.BICUBIC), T.ToTensor()])), "BICUBIC"),
    (lambda r: datasets.ImageFolder(r, transform=T.Compose([
        T.ToTensor(), T.Normalize(MEAN, STD), T.RandomResizedCrop(64)])), "RandomResizedCrop"),
    (lambda r: datasets.ImageFolder(r, transform=T.RandomResizedCrop(64)), "PIL images"),
    (lambda r: datasets.ImageFolder(r), "transform=None"),
    (lambda r: datasets.ImageFolder(r, transform=T.ToTensor(),
                                    loader=lambda p: Image.open(p).convert("RGB")), "loader="),
    (lambda r: OwnGetItem(r, transform=T.ToTensor()), "OwnGetItem.__getitem__"),
    (lambda r: torch.utils.data.TensorDataset(torch.zeros(2)), "not a torchvision"),
])
def test_unrecognised_pipelines_warn_once_and_run_unchanged(make, named, root):
    dataset = make(str(root))
    with pytest.warns(UserWarning, match="fastfeed.vision.accelerate") as caught:
        result = accelerate(dataset)
    assert len(caught) == 1 and named in str(caught[0].message)
    assert result is dataset


def test_center_crop_that_pads_takes_the_stock_path(root):
    transform = T.Compose([T.CenterCrop(900), T.ToTensor()])
    stock = datasets.ImageFolder(str(root), transform=transform)
    fast = accelerate(stock)
    assert torch.equal(fast[0][0], stock[0][0])


@pytest.mark.parametrize("name", ["v1-train", "v2-train", "v1-uint8"])
def test_batches_match_torch_dataloader_side_by_side(name, root):
    stock = datasets.ImageFolder(str(root), transform=PIPELINES[name]())
    kwargs = {"batch_size": 4, "shuffle": True, "num_workers": 2, "persistent_workers": True}
    expected = DataLoader(stock, generator=torch.Generator().manual_seed(3), **kwargs)
    got = FastLoader(accelerate(stock), generator=torch.Generator().manual_seed(3), **kwargs)
    for _ in range(2):
        pairs = list(zip(expected, got, strict=True))
        assert len(pairs) == len(expected)
        for (images, targets), (fast_images, fast_targets) in pairs:
            assert torch.equal(targets, fast_targets)
            assert fast_images.shape == images.shape and fast_images.dtype == images.dtype
            scale = 255 * (torch.tensor(STD).view(1, 3, 1, 1) if "train" in name else 1)
            assert float(((images - fast_images).float() * scale).abs().mean()) <= 2.0


@pytest.mark.parametrize("name", ["v1-train", "v2-eval", "v1-uint8"])
def test_deferred_tail_gives_identical_values(name, root):
    stock = datasets.ImageFolder(str(root), transform=PIPELINES[name]())
    kwargs = {"batch_size": 5, "shuffle": True, "num_workers": 2}
    per_sample = FastLoader(accelerate(stock), generator=torch.Generator().manual_seed(1),
                            **kwargs)
    deferred = accelerate(stock, defer_tail=True)
    on_device = FastLoader(deferred, generator=torch.Generator().manual_seed(1), device="cpu",
                           gpu_transform=batch_tail(deferred), **kwargs)
    for (images, targets), (device_images, device_targets) in zip(per_sample, on_device,
                                                                  strict=True):
        assert torch.equal(targets, device_targets)
        assert type(device_images) is type(images) and torch.equal(device_images, images)
    item, _ = deferred[0]
    assert item.dtype == torch.uint8


def test_batch_tail_needs_a_deferred_dataset(root):
    fast = accelerate(datasets.ImageFolder(str(root), transform=T.ToTensor()))
    with pytest.raises(ValueError, match="defer_tail=True"):
        batch_tail(fast)


def test_spawned_workers_and_a_corrupt_file(root, tmp_path):
    bad = tmp_path / "bad"
    (bad / "a").mkdir(parents=True)
    buffer = io.BytesIO()
    make_image(random.Random(0), 120, 90).save(buffer, "JPEG")
    (bad / "a" / "ok.jpg").write_bytes(buffer.getvalue())
    (bad / "a" / "truncated.jpg").write_bytes(buffer.getvalue()[:200])
    fast = accelerate(datasets.ImageFolder(str(bad), transform=T.Compose([
        T.RandomResizedCrop(64), T.ToTensor()])))
    loader = FastLoader(fast, batch_size=1, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(OSError, match=r"truncated\.jpg"):
        list(loader)


def test_bench_compares_the_users_pipeline(root, tmp_path):
    out = subprocess.run([sys.executable, "-m", "fastfeed", "bench", "--data", str(root),
                          "--workers", "2", "--batches", "2", "--repeats", "1",
                          "--batch-size", "4", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    results = json.loads((tmp_path / "bench.json").read_text())["results"]
    configs = [r["config"] for r in results]
    assert configs[-3:] == ["torchvision", "torchvision+swap", "torchvision+accelerate"]
    assert "torchvision+accelerate" in out.stdout


def test_torchvision_training_example_runs(tmp_path):
    script = Path(__file__).resolve().parents[1] / "examples" / "train_torchvision.py"
    out = subprocess.run([sys.executable, str(script), "--generate", "32", "--epochs", "1",
                          "--batch-size", "8", "--arch", "resnet18", "--device", "cpu"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "epoch 0: loss" in out.stdout and "samples/s" in out.stdout
