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
from unittest import mock

import numpy as np
import pytest
import torch
from clients import import_or_skip
from torch.overrides import TorchFunctionMode

pytestmark = pytest.mark.clients
import_or_skip("torchvision")
from PIL import Image  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchvision import datasets  # noqa: E402
from torchvision import transforms as T  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

from fastfeed import FastLoader  # noqa: E402
from fastfeed._torch_compat import default_collate  # noqa: E402
from fastfeed.collate import torch_empty  # noqa: E402
from fastfeed.slots import Arena  # noqa: E402
from fastfeed.tail_split import batch_tail_split, plan_tail  # noqa: E402
from fastfeed.vision import ImageFolder as FastImageFolder  # noqa: E402
from fastfeed.vision.accelerate import (  # noqa: E402
    BatchTail,
    FusedTransform,
    TailCollate,
    accelerate,
    batch_tail,
    deferred_for_device,
    torch_draws,
)
from fastfeed.vision.accelerate import geometry as geometry_module  # noqa: E402
from fastfeed.vision.synthetic import make_image, make_imagefolder  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import assert_same  # noqa: E402

from benchmarks.recipes_pipeline import ReferencePresetEval, ReferencePresetTrain  # noqa: E402

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
    # A prefix, then the user's own tail on the object the prefix gives.
    "v1-jitter": lambda: T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(),
                                    T.ColorJitter(0.4, 0.4, 0.4, 0.1), T.ToTensor(),
                                    T.Normalize(MEAN, STD)]),
    "v1-pil-output": lambda: T.Compose([T.RandomResizedCrop(96), T.RandomHorizontalFlip()]),
    "v1-bicubic": lambda: T.Compose([T.Resize(256, interpolation=T.InterpolationMode.BICUBIC),
                                     T.CenterCrop(224), T.PILToTensor()]),
    "v1-erasing": lambda: T.Compose([T.RandomResizedCrop(128), T.RandomHorizontalFlip(),
                                     T.PILToTensor(), T.ConvertImageDtype(torch.float32),
                                     T.Normalize(MEAN, STD), T.RandomErasing(p=0.7)]),
    "v1-geometry-in-tail": lambda: T.Compose([T.ToTensor(), T.Normalize(MEAN, STD),
                                              T.RandomResizedCrop(64)]),
    "v2-trivialaugment": lambda: v2.Compose([v2.RandomResizedCrop(128),
                                             v2.RandomHorizontalFlip(),
                                             v2.TrivialAugmentWide(), v2.PILToTensor()]),
    "v2-reference": lambda: v2.Compose([v2.RandomResizedCrop(176, antialias=True),
                                        v2.RandomHorizontalFlip(), v2.PILToTensor(),
                                        v2.ToDtype(torch.float, scale=True),
                                        v2.Normalize(MEAN, STD), v2.RandomErasing(0.5),
                                        v2.ToPureTensor()]),
    # torchvision's reference presets: a Compose in `.transforms`, called through.
    "reference-train": lambda: ReferencePresetTrain(176, random_erase_prob=0.5),
    "reference-eval": ReferencePresetEval,
    # Tails that can run on whole batches.
    "reference-train-batchable": lambda: ReferencePresetTrain(176),
    "v1-eval-padded": lambda: T.Compose([T.Resize(48), T.CenterCrop(64), T.ToTensor(),
                                         T.Normalize(MEAN, STD)]),
    "v2-batchable": lambda: v2.Compose([v2.RandomResizedCrop(176), v2.RandomHorizontalFlip(),
                                        v2.PILToTensor(), v2.ToDtype(torch.float, scale=True),
                                        v2.Normalize(MEAN, STD), v2.ToPureTensor()]),
}


# Auto-augment ops quantise (posterize, solarize, equalize): a fraction of a grey level in
# their input can move a pixel by many. The draws must still be the same.
GREY_LEVELS = {"v2-trivialaugment": 8.0}


def sample_folder(path):
    """ImageNet-like JPEGs in three classes, with a PNG and a grey JPEG: both must still match
    the stock pipeline."""
    root = make_imagefolder(path, images=18, classes=3)
    rng = random.Random(5)
    make_image(rng, 300, 220).save(root / "class_001" / "extra.png")
    make_image(rng, 260, 300).convert("L").save(root / "class_002" / "grey.jpg", quality=90)
    return root


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return sample_folder(tmp_path_factory.mktemp("tv"))


def grey_levels(stock, fast, transform, unscaled=False):
    """Mean |Δ| in 0–255 grey levels, with Normalize undone (``unscaled``: floats in 0–255,
    as timm's ToTensor gives)."""
    if isinstance(stock, Image.Image):
        stock, fast = T.functional.pil_to_tensor(stock), T.functional.pil_to_tensor(fast)
    a, b = stock.float(), fast.float()
    if stock.is_floating_point() and not unscaled:
        a, b = a * 255, b * 255
        if "Normalize" in repr(getattr(transform, "transforms", transform)):
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
    assert_same_as_stock(stock, fast, Recorder(monkeypatch), GREY_LEVELS.get(name, 2.0))


def seed_all(seed):
    """What a DataLoader worker seeds: torch's, Python's and numpy's generators."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def rng_states():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1]


def assert_same_as_stock(stock, fast, recorder, max_grey_levels=2.0):
    """Every item, stock then accelerated from the same seeds: the same draws (recorded crop
    windows, and the generators' states after the item), labels, type, dtype and shape, and
    pixels within ``max_grey_levels`` on average."""
    unscaled = (fast.transform.plan.conversion or ("",))[0] == "timm.ToTensor"
    for index in range(len(stock)):
        seed_all(index)
        image, target = stock[index]
        stock_draws, (torch_state, python_state, numpy_state) = recorder.take(), rng_states()
        seed_all(index)
        fast_image, fast_target = fast[index]
        assert recorder.take() == stock_draws
        fast_torch, fast_python, fast_numpy = rng_states()
        assert torch.equal(fast_torch, torch_state), "a different number of torch draws"
        assert fast_python == python_state, "a different number of Python random draws"
        assert np.array_equal(fast_numpy, numpy_state), "a different number of numpy draws"
        assert fast_target == target
        assert type(fast_image) is type(image)
        if isinstance(image, np.ndarray):  # timm's ToNumpy
            image, fast_image = torch.from_numpy(image), torch.from_numpy(fast_image)
        if isinstance(image, Image.Image):
            assert fast_image.mode == image.mode and fast_image.size == image.size
        else:
            assert fast_image.dtype == image.dtype and fast_image.shape == image.shape
            assert fast_image.is_contiguous() or not image.is_contiguous()
        assert grey_levels(image, fast_image, stock.transform, unscaled) <= max_grey_levels, \
            stock.samples[index][0]


class NoRecorder:
    def take(self):
        return []


@pytest.mark.parametrize("name", ["v1-train", "v1-nested", "v1-uint8", "v1-jitter", "v2-train",
                                  "reference-train"])
def test_worker_processes_draw_the_same_windows_without_torch_ops(name, root):
    """In a worker process's main thread, torchvision's own RandomResizedCrop and flips are
    drawn from a copy of the generator's state (torch_draws): the same windows (pixels as
    close as ever) and the generator left where torchvision's ops leave it; other crops
    (v2's) keep their own draws."""
    transform = PIPELINES[name]()
    stock = datasets.ImageFolder(str(root), transform=transform)
    fast = accelerate(stock)
    with mock.patch.object(torch_draws, "get_worker_info", return_value=object()), \
            mock.patch.object(torch_draws.Draws, "commit", autospec=True,
                              side_effect=torch_draws.Draws.commit) as commits:
        assert_same_as_stock(stock, fast, NoRecorder(), GREY_LEVELS.get(name, 2.0))
    assert commits.call_count == (len(stock) if name.startswith(("v1", "reference")) else 0)


def test_copied_draws_give_torchvisions_windows_at_every_size():
    """draw_window's copied draws against torchvision's own, over image sizes, scales and
    ratios (a window that falls back to the centre crop included)."""
    rng = random.Random(0)
    for seed in range(400):
        width, height = rng.randint(8, 3000), rng.randint(8, 3000)
        geometry = [("RandomResizedCrop", T.RandomResizedCrop(
            64, scale=rng.choice([(0.08, 1.0), (0.9, 1.0), (0.2, 0.3)]),
            ratio=rng.choice([(3 / 4, 4 / 3), (0.2, 5.0), (4.0, 5.0)]))),
            ("RandomHorizontalFlip", T.RandomHorizontalFlip())]
        torch.manual_seed(seed)
        expected = vars(geometry_module._fold(geometry, width, height, None))
        after = torch.get_rng_state()
        torch.manual_seed(seed)
        with mock.patch.object(torch_draws, "get_worker_info", return_value=object()):
            assert vars(geometry_module.draw_window(geometry, width, height)) == expected
        assert torch.equal(torch.get_rng_state(), after)


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


class DoesMore:
    """A wrapper holding a Compose that does more than call it: not taken apart."""

    def __init__(self):
        self.transforms = T.Compose([T.RandomResizedCrop(64), T.PILToTensor()])

    def __call__(self, image):
        return self.transforms(image).flip(-1)


def test_the_prefix_and_the_users_tail(root):
    """What runs the fast way and what the user's own objects run, for the common shapes."""
    fast = accelerate(datasets.ImageFolder(str(root), transform=PIPELINES["v1-jitter"]()))
    plan = fast.transform.plan
    assert [name for name, _ in plan.geometry] == ["RandomResizedCrop", "RandomHorizontalFlip"]
    assert plan.conversion is None, "ColorJitter is handed a PIL image"
    assert [type(t).__name__ for t in plan.tail] == ["ColorJitter", "ToTensor", "Normalize"]
    preset = ReferencePresetTrain(random_erase_prob=0.5)
    plan = accelerate(datasets.ImageFolder(str(root), transform=preset)).transform.plan
    assert plan.conversion[0] == "PILToTensor"
    assert plan.tail == list(preset.transforms.transforms[3:]), "the user's own objects"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_to_image_pipeline_gives_plain_tensor_batches(num_workers, root):
    pipeline = v2.Compose([v2.RandomResizedCrop(32), v2.ToImage(),
                           v2.ToDtype(torch.float32, scale=True),
                           v2.Normalize([0.5] * 3, [0.2] * 3)])
    fast = accelerate(datasets.ImageFolder(str(root), transform=pipeline))

    def first(cls):
        torch.manual_seed(0)
        return next(iter(cls(fast, batch_size=4, num_workers=num_workers)))[0]

    expected, got = first(DataLoader), first(FastLoader)
    assert type(got) is type(expected) is torch.Tensor
    assert torch.equal(got, expected)


def test_a_second_resize_is_the_users_own(root):
    # Resize(16) then Resize(64) is a blurred upscale in torchvision: one resize from the
    # source window would be sharp. The fast prefix stops before the second.
    pipeline = T.Compose([T.Resize(16), T.Resize(64), T.RandomResizedCrop(32), T.ToTensor()])
    plan = accelerate(datasets.ImageFolder(str(root), transform=pipeline)).transform.plan
    assert [name for name, _ in plan.geometry] == ["Resize"]
    assert plan.tail == list(pipeline.transforms[1:])


@pytest.mark.parametrize(("make", "named"), [
    (lambda r: datasets.ImageFolder(r, transform=T.Compose([])), "empty"),
    (lambda r: datasets.ImageFolder(r, transform=T.Compose([
        T.Resize(100, max_size=90), T.ToTensor()])), "max_size=90"),
    (lambda r: datasets.ImageFolder(r, transform=T.Compose([
        T.ColorJitter(0.4), T.RandomResizedCrop(64), T.ToTensor()])), "ColorJitter"),
    (lambda r: datasets.ImageFolder(r, transform=T.Compose([
        T.Lambda(lambda x: x), T.ToTensor()])), "Lambda"),
    (lambda r: datasets.ImageFolder(r, transform=T.Compose([
        T.Resize(64, interpolation=T.InterpolationMode.NEAREST), T.ToTensor()])), "NEAREST"),
    (lambda r: datasets.ImageFolder(r, transform=DoesMore()), "DoesMore"),
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


@pytest.mark.parametrize(("name", "defer"), [
    ("v1-train", "defer_tail"), ("v2-eval", "defer_tail"), ("v1-uint8", "defer_tail"),
    ("reference-train-batchable", "for_device"), ("v2-batchable", "for_device"),
    ("v1-train", "for_device")])
def test_deferred_tail_gives_identical_values(name, defer, root):
    stock = datasets.ImageFolder(str(root), transform=PIPELINES[name]())
    kwargs = {"batch_size": 5, "shuffle": True, "num_workers": 2}
    per_sample = DataLoader(accelerate(stock), generator=torch.Generator().manual_seed(1),
                            **kwargs)
    if defer == "defer_tail":
        deferred = accelerate(stock, defer_tail=True)
        tail = batch_tail(deferred)
    else:
        deferred, tail = deferred_for_device(accelerate(stock))
    on_device = FastLoader(deferred, generator=torch.Generator().manual_seed(1), device="cpu",
                           gpu_transform=tail, **kwargs)
    for (images, targets), (device_images, device_targets) in zip(per_sample, on_device,
                                                                  strict=True):
        assert torch.equal(targets, device_targets)
        assert type(device_images) is type(images) and torch.equal(device_images, images)
    item, _ = deferred[0]
    assert item.dtype == torch.uint8


LOADER_MODES = {
    "0-workers": {"num_workers": 0},
    "2-workers": {"num_workers": 2},
    "2-workers-persistent": {"num_workers": 2, "persistent_workers": True},
    "threads": {"num_workers": 2, "worker_mode": "thread"},
    "device-cpu": {"num_workers": 2, "device": "cpu"},
}


@pytest.mark.parametrize("mode", LOADER_MODES)
@pytest.mark.parametrize("name", ["v1-train", "v2-batchable", "reference-train-batchable",
                                  "v1-eval-padded", "v1-uint8", "v1-jitter"])
def test_accelerated_batches_equal_the_per_sample_pipeline(name, mode, root):
    """Issue 24, parts 1 and 2: FastLoader runs an accelerated dataset's batchable tail on
    whole batches (in the workers, straight into the pool slot; or on the device), and gives
    exactly the batches of torch's DataLoader over the same dataset, item by item."""
    if mode == "threads" and name != "v1-eval-padded":
        pytest.skip("threads share the global RNGs: the order of random draws varies")
    fast = accelerate(datasets.ImageFolder(str(root), transform=PIPELINES[name]()))
    kwargs = {"batch_size": 4, "shuffle": True}
    options = LOADER_MODES[mode]
    torch_options = {k: v for k, v in options.items() if k not in ("device", "worker_mode")}
    stock = DataLoader(fast, generator=torch.Generator().manual_seed(3), **torch_options,
                       **kwargs)
    loader = FastLoader(fast, generator=torch.Generator().manual_seed(3), **options, **kwargs)

    def two_epochs(loader):  # one after the other: without workers, both draw from torch's RNG
        torch.manual_seed(0)
        return [batch for _ in range(2) for batch in loader]

    expected, got = two_epochs(stock), two_epochs(loader)
    assert len(got) == len(expected) == 2 * len(stock)
    for (images, targets), (fast_images, fast_targets) in zip(expected, got, strict=True):
        assert torch.equal(fast_targets, targets)
        assert type(fast_images) is type(images) and torch.equal(fast_images, images)


def test_what_the_workers_run(root):
    """The decision: workers read uint8 items; without a device they collate with the tail
    into the slot, with one the device iterator runs the tail; a custom collate_fn, a
    per-sample tail or a dataset not from accelerate leaves the loader as it is."""
    fast = accelerate(datasets.ImageFolder(str(root), transform=PIPELINES["v1-train"]()))
    iterator = iter(FastLoader(fast, batch_size=4, num_workers=1))
    assert isinstance(iterator._collate_fn, TailCollate)
    assert iterator._dataset.transform.defer_tail and iterator._dataset[0][0].dtype == torch.uint8
    on_device = iter(FastLoader(fast, batch_size=4, num_workers=1, device="cpu"))
    assert on_device._host._collate_fn is default_collate
    assert on_device._host._dataset.transform.defer_tail
    assert isinstance(on_device._transform, BatchTail)
    # Ray workers: they collate uint8, and the main process runs the tail as batches land.
    on_ray = plan_tail(batch_tail_split(fast, default_collate, True), on_device=False,
                       lands_batches=True)
    assert on_ray.collate_fn is None and on_ray.device_tail is None
    assert on_ray.dataset.transform.defer_tail and on_ray.landing_tail is not None
    per_sample = accelerate(datasets.ImageFolder(str(root), transform=PIPELINES["v1-jitter"]()))
    stock = datasets.ImageFolder(str(root), transform=PIPELINES["v1-train"]())
    for loader in (FastLoader(fast, batch_size=4, collate_fn=lambda b: default_collate(b)),
                   FastLoader(per_sample, batch_size=4), FastLoader(stock, batch_size=4),
                   FastLoader(fast, batch_size=None)):
        iterator = iter(loader)
        assert not isinstance(iterator._collate_fn, TailCollate)
        assert iterator._dataset is loader.dataset


def test_persistent_workers_keep_their_tail(root):
    """Persistent workers keep the dataset and collate of their first epoch (as torch's do):
    the device iterator must keep finishing their uint8 batches even if the loader's
    collate_fn changes between epochs."""
    fast = accelerate(datasets.ImageFolder(str(root), transform=PIPELINES["v1-eval"]()))
    kwargs = {"batch_size": 4, "num_workers": 2, "persistent_workers": True}
    expected = list(DataLoader(fast, **kwargs))
    loader = FastLoader(fast, device="cpu", **kwargs)
    assert_same(list(loader), expected)
    loader.collate_fn = collate_per_sample
    assert_same(list(loader), expected)


def collate_per_sample(samples):
    return default_collate(samples)


@pytest.mark.parametrize(("name", "in_slot"), [
    ("v1-train", True), ("reference-train-batchable", True), ("v2-batchable", False)])
def test_tail_collate_writes_the_float_batch_into_the_slot(name, in_slot, root):
    """In a worker, the float batch is computed where the slot's arena puts it, with the
    values and structure of default_collate + the tail; without room, the same values. A
    tail that does not start with a division by 255 runs as it is."""
    fast = accelerate(datasets.ImageFolder(str(root), transform=PIPELINES[name]()))
    deferred, tail = deferred_for_device(fast)
    collate = TailCollate(tail)
    samples = [deferred[i] for i in range(5)]
    expected = collate(samples)
    arena = Arena(0, torch.zeros(8 << 20, dtype=torch.uint8))
    images, targets = collate.collate_into(samples, arena.empty)
    assert arena.owns(images) == in_slot and torch.equal(images, expected[0])
    assert torch.equal(targets, expected[1]) and torch.equal(targets, default_collate(
        [s[1] for s in samples]))
    no_room = Arena(0, torch.zeros(1024, dtype=torch.uint8))
    images, _ = collate.collate_into(samples, no_room.empty)
    assert not no_room.owns(images) and torch.equal(images, expected[0])
    # Landing a batch from Ray workers: the same, from the collated uint8 batch.
    landing = Arena(0, torch.zeros(8 << 20, dtype=torch.uint8))
    landed = tail.finish_into(default_collate(samples), landing.empty)
    assert_same(landed, expected)
    assert landing.owns(landed[0]) == in_slot
    assert pickle.loads(pickle.dumps(collate))._staging is None


@pytest.mark.parametrize("name", ["v1-train", "v1-single", "reference-train-batchable"])
def test_a_per_channel_tail_is_looked_up_as_the_images_are_gathered(name, root, monkeypatch):
    """ToTensor then Normalize (or nothing) is elementwise per channel: the worker tabulates
    it once and looks each byte up as it gathers, in one pass; every byte value in every
    channel gives the staged batch's value, bit for bit."""
    tail_ops_module = sys.modules[TailCollate.__module__]
    fast = accelerate(datasets.ImageFolder(str(root), transform=PIPELINES[name]()))
    _, tail = deferred_for_device(fast)
    g = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, 256, (3, 40, 33), dtype=torch.uint8, generator=g), i)
               for i in range(7)]
    samples[0][0].view(3, -1)[:, :256] = torch.arange(256, dtype=torch.uint8)
    looked_up = []
    gather = tail_ops_module.gather_through_tables
    monkeypatch.setattr(tail_ops_module, "gather_through_tables",
                        lambda *args: looked_up.append(1) or gather(*args))
    images, _ = TailCollate(tail).collate_into(samples, torch_empty)
    staged = tail.into(torch.stack([s[0] for s in samples]), torch_empty)
    assert looked_up and images.dtype == staged.dtype == torch.float32
    assert torch.equal(images, staged)


def test_a_tail_in_another_float_dtype_is_not_tabulated(root):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        fast = accelerate(datasets.ImageFolder(str(root), transform=PIPELINES["v1-train"]()))
        _, tail = deferred_for_device(fast)
        assert tail.converts_to_float and tail.tables(3) is None
    finally:
        torch.set_default_dtype(previous)


class Divisions(TorchFunctionMode):
    """Records divisions by a Python number (CUDA computes those as a multiply by the
    reciprocal: not the CPU's result)."""

    def __init__(self):
        super().__init__()
        self.by_number = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in ("div", "div_", "true_divide", "__truediv__", "__itruediv__"):
            divisor = args[1] if len(args) > 1 else kwargs.get("other")
            if not isinstance(divisor, torch.Tensor):
                self.by_number.append(f"{name}({divisor!r})")
        return func(*args, **kwargs)


def test_the_device_tail_divides_by_tensors(root):
    """On CUDA, ``x / 255`` with a Python 255 is ``x * (1/255)``, which differs from the CPU's
    true division (torchvision's ToTensor) in the last bit of 126 of the 256 grey levels. The
    deferred tail divides by tensors only, so the device gives the per-sample values."""
    x = np.arange(256, dtype=np.float32)
    assert (x / np.float32(255) != x * (np.float32(1) / np.float32(255))).sum() == 126
    for name in ("v1-train", "reference-train-batchable", "v1-uint8"):
        stock = datasets.ImageFolder(str(root), transform=PIPELINES[name]())
        _, tail = deferred_for_device(accelerate(stock))
        batch = [torch.empty(4, 3, 8, 8, dtype=torch.uint8, device="meta"), torch.zeros(4)]
        with Divisions() as divisions:
            tail(batch)
        assert divisions.by_number == [], name
    with Divisions() as divisions:  # what the test catches: torchvision's own ToTensor
        T.ToTensor()(Image.new("RGB", (4, 4)))
    assert divisions.by_number


def test_batch_tail_needs_a_deferred_dataset(root):
    fast = accelerate(datasets.ImageFolder(str(root), transform=T.ToTensor()))
    with pytest.raises(ValueError, match="defer_tail=True"):
        batch_tail(fast)


@pytest.mark.parametrize(("name", "per_sample"), [
    ("v1-jitter", "PIL"), ("v1-erasing", "RandomErasing"), ("reference-train", "RandomErasing"),
    ("v1-pil-output", "PIL")])
def test_a_per_sample_tail_is_not_deferred(name, per_sample, root):
    """The decision a loader with a device makes, and what defer_tail=True does, when a piece
    of the tail must run per sample: items keep the user's output."""
    stock = datasets.ImageFolder(str(root), transform=PIPELINES[name]())
    assert deferred_for_device(accelerate(stock)) is None
    with pytest.warns(UserWarning, match=f"defer_tail=True ignored.*{per_sample}"):
        fast = accelerate(stock, defer_tail=True)
    assert not fast.transform.defer_tail
    with pytest.raises(ValueError, match="defer_tail=True"):
        batch_tail(fast)


def test_deferral_decision(root):
    """Only an accelerated dataset, not already deferred, with a batchable tail."""
    stock = datasets.ImageFolder(str(root), transform=PIPELINES["v1-train"]())
    assert deferred_for_device(stock) is None
    assert deferred_for_device(accelerate(stock, defer_tail=True)) is None
    fast = accelerate(stock)
    deferred, tail = deferred_for_device(fast)
    assert isinstance(tail, BatchTail) and deferred.transform.defer_tail
    assert not fast.transform.defer_tail and deferred.samples == fast.samples
    assert deferred[0][0].dtype == torch.uint8


class HostTraffic(TorchFunctionMode):
    """Records torch calls that read tensor data on the host or make device tensors from host
    data (``torch.as_tensor(..., device=)``, ``.to(device)`` of a CPU tensor)."""

    HOST_READS = ("__bool__", "item", "tolist", "__int__", "__float__")

    def __init__(self):
        super().__init__()
        self.events = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in self.HOST_READS:
            self.events.append(f"host read: {name}")
        out = func(*args, **kwargs)
        leaves = torch.utils._pytree.tree_leaves
        inputs = [a for a in leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outputs = [o for o in leaves(out) if isinstance(o, torch.Tensor)]
        on_device = any(o.device.type != "cpu" for o in outputs)
        if on_device and (not inputs or any(i.device.type == "cpu" for i in inputs)):
            self.events.append(f"host-to-device: {name}")
        return out


@pytest.mark.parametrize("name", ["v1-train", "v2-batchable", "reference-train-batchable"])
def test_batch_tail_is_sync_free(name, root):
    """Issue 23, finding 8. On the "meta" device (a stand-in for CUDA: data-dependent host
    reads raise there), the deferred tail reads nothing back (torchvision's Normalize checks
    ``(std == 0).any()`` every call) and copies mean/std to the device once, not per batch."""
    stock = datasets.ImageFolder(str(root), transform=PIPELINES[name]())
    _, tail = deferred_for_device(accelerate(stock))
    batch = [torch.empty(4, 3, 8, 8, dtype=torch.uint8, device="meta"), torch.zeros(4)]
    tail(batch)  # the first batch makes mean and std on the device
    with HostTraffic() as traffic:
        for _ in range(3):
            images, _ = tail(batch)
    assert traffic.events == [] and images.device.type == "meta"
    # What the test catches: torchvision's Normalize copies mean/std and reads (std == 0).any()
    # on every call.
    floats = torch.empty(4, 3, 8, 8, device="meta")
    with HostTraffic() as traffic, pytest.raises((RuntimeError, NotImplementedError)):
        T.Normalize(MEAN, STD)(floats)
    assert "host-to-device: as_tensor" in traffic.events
    assert "host read: __bool__" in traffic.events


def test_batch_tail_normalizes_as_torchvision(root):
    """The same values as torchvision's Normalize (v1 and v2, tensor mean/std as timm passes),
    its zero-std error, and the type default_collate gives v2's images: a plain tensor."""
    images = torch.rand(4, 3, 8, 8)
    for normalize in (T.Normalize(MEAN, STD), v2.Normalize(MEAN, STD),
                      T.Normalize(torch.tensor(MEAN), torch.tensor(STD))):
        stock = datasets.ImageFolder(str(root), transform=T.Compose([T.ToTensor(), normalize]))
        _, tail = deferred_for_device(accelerate(stock))
        got, _ = tail([(images * 255).round().to(torch.uint8), None])
        assert torch.equal(got, normalize(T.ConvertImageDtype(torch.float)(
            (images * 255).round().to(torch.uint8))))
    stock = datasets.ImageFolder(str(root), transform=v2.Compose([
        v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]))
    _, tail = deferred_for_device(accelerate(stock))
    got, _ = tail([torch.zeros(2, 3, 4, 4, dtype=torch.uint8), None])
    assert type(got) is torch.Tensor
    stock = datasets.ImageFolder(str(root), transform=T.Compose([
        T.ToTensor(), T.Normalize(MEAN, [0.2, 0.0, 0.2])]))
    _, tail = deferred_for_device(accelerate(stock))
    with pytest.raises(ValueError, match="std evaluated to zero"):
        tail([torch.zeros(2, 3, 4, 4, dtype=torch.uint8), None])


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


def test_sharp_images_stay_close_to_the_users_pipeline(tmp_path):
    # Sharp edges show what a coarse DCT scale loses (the tests' other images are smooth):
    # decoding the window at twice the output size keeps it close to Pillow's full decode.
    rng = np.random.default_rng(0)
    for label in ("a", "b"):
        (tmp_path / label).mkdir()
        for i in range(3):
            blocks = rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)
            sharp = Image.fromarray(blocks).resize((480, 360), Image.Resampling.NEAREST)
            sharp.save(tmp_path / label / f"{i}.jpg", quality=95)
    stock = datasets.ImageFolder(str(tmp_path), transform=T.Compose([
        T.RandomResizedCrop(64), T.PILToTensor()]))
    fast = accelerate(stock)
    differences = []
    for seed in range(10):
        for index in range(len(stock)):
            torch.manual_seed(seed * 100 + index)
            expected, _ = stock[index]
            torch.manual_seed(seed * 100 + index)
            got, _ = fast[index]
            differences.append((expected.float() - got.float()).abs().mean().item())
    assert np.mean(differences) < 4.0, np.mean(differences)  # 10.8 at a 1x margin
