"""``fastfeed.ultralytics`` against Ultralytics' own loaders and image reader, side by side.

Needs Ultralytics (the ``ultralytics`` extra; CI runs this file in its client environment).
"""

import contextlib
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.clients
os.environ.setdefault("YOLO_OFFLINE", "1")  # no downloads, no telemetry
try:
    import cv2
    import ultralytics  # noqa: F401
except Exception as error:  # missing, or its torchvision built for another torch
    pytest.skip(f"needs ultralytics: {error}", allow_module_level=True)
from helpers import assert_same  # noqa: E402
from PIL import Image  # noqa: E402
from procs import assert_no_leaks, child_pids, open_fds, snapshot, wait_until  # noqa: E402
from ultralytics.cfg import get_cfg  # noqa: E402
from ultralytics.data import build_dataloader, build_yolo_dataset  # noqa: E402
from ultralytics.data.build import seed_worker  # noqa: E402
from ultralytics.utils import DEFAULT_CFG  # noqa: E402
from ultralytics.utils.patches import imread  # noqa: E402

import fastfeed.ultralytics as fu  # noqa: E402
from fastfeed.ultralytics.decode import dct_scale, target_size  # noqa: E402
from fastfeed.vision.synthetic import make_image, make_imagefolder, make_yolo  # noqa: E402

NAMES = {i: f"c{i}" for i in range(8)}


@pytest.fixture(autouse=True)
def _unpatched():
    fu.unpatch()
    yield
    fu.unpatch()


@pytest.fixture(scope="module")
def yolo_root(tmp_path_factory):
    return make_yolo(tmp_path_factory.mktemp("yolo"), images=24)


@pytest.fixture(scope="module")
def large_root(tmp_path_factory):
    return make_yolo(tmp_path_factory.mktemp("large"), images=6, widths=(1280, 1920))


def dataset(root, mode="train", imgsz=160, batch=4):
    cfg = get_cfg(DEFAULT_CFG, {"imgsz": imgsz})  # close_mosaic edits it: one per dataset
    data = {"names": NAMES, "nc": len(NAMES), "channels": 3}
    return cfg, build_yolo_dataset(cfg, str(root / "images"), batch, data, mode=mode)


def epochs_with_close_mosaic(root, shuffle=True, workers=2):
    """Two epochs, then mosaic off and ``reset()``, then one more: what the trainer does."""
    torch.manual_seed(0)
    random.seed(0)  # without workers, augmentations draw from the main process's RNGs
    np.random.seed(0)
    cfg, data = dataset(root)
    loader = build_dataloader(data, 4, workers, shuffle=shuffle, rank=-1)
    epochs = [list(loader), list(loader)]
    data.close_mosaic(cfg)
    loader.reset()
    epochs.append(list(loader))
    loader.close()
    return type(loader), epochs


@pytest.mark.parametrize(("shuffle", "workers"), [(True, 2), (False, 2), (True, 0)],
                         ids=["train", "val", "cpu-training"])
def test_patched_batches_equal_stock(yolo_root, shuffle, workers):
    stock_type, stock = epochs_with_close_mosaic(yolo_root, shuffle, workers)
    fu.patch()
    fast_type, fast = epochs_with_close_mosaic(yolo_root, shuffle, workers)
    assert stock_type.__name__ == "InfiniteDataLoader"
    assert issubclass(fast_type, fu.InfiniteFastLoader)
    assert [len(e) for e in fast] == [len(e) for e in stock] == [6, 6, 6]
    assert_same(fast, stock)


def test_classification_batches_equal_stock(tmp_path):
    """The classify trainer's loader goes through the same build_dataloader."""
    from ultralytics.data import ClassificationDataset

    root = make_imagefolder(tmp_path / "cls", images=40, classes=4)
    runs = []
    for patched in (False, True):
        if patched:
            fu.patch()
        torch.manual_seed(0)
        cfg = get_cfg(DEFAULT_CFG, {"imgsz": 64})
        data = ClassificationDataset(str(root), cfg, augment=True, prefix="train")
        loader = build_dataloader(data, 8, 2, shuffle=True, rank=-1)
        runs.append([list(loader), list(loader)])
        loader.close()
    assert len(runs[0][0]) == 5
    assert_same(runs[1], runs[0])


def test_ddp_sampler_batches_equal_stock(yolo_root, tmp_path):
    """Under DDP Ultralytics passes a DistributedSampler (train) and calls set_epoch."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    try:
        runs = []
        for patched in (False, True):
            if patched:
                fu.patch()
            torch.manual_seed(0)
            loader = build_dataloader(dataset(yolo_root)[1], 4, 2, shuffle=True, rank=0)
            epochs = []
            for epoch in range(2):
                loader.sampler.set_epoch(epoch)
                epochs.append(list(loader))
            loader.close()
            runs.append((type(loader.sampler).__name__, epochs))
        assert runs[0][0] == runs[1][0] == "DistributedSampler"
        assert_same(runs[1][1], runs[0][1])
    finally:
        dist.destroy_process_group()


def test_patched_loader_has_ultralytics_arguments(yolo_root):
    fu.patch(log_every=1000)
    torch.manual_seed(0)
    loader = build_dataloader(dataset(yolo_root)[1], 4, 2, shuffle=True, rank=-1)
    assert isinstance(loader, fu.InfiniteFastLoader)
    assert loader.worker_init_fn is seed_worker and loader.generator is not None
    assert (loader.num_workers, loader.prefetch_factor, loader.batch_size) == (2, 4, 4)
    assert loader.log_every == 1000 and len(loader) == 6
    assert loader.collate_fn is loader.dataset.collate_fn


def test_workers_persist_across_epochs_and_restart_on_reset(yolo_root):
    before = snapshot()
    fu.patch()
    loader = build_dataloader(dataset(yolo_root)[1], 4, 2, shuffle=True, rank=-1)
    list(loader)
    first = loader.iterator
    list(loader)
    assert loader.iterator is first  # one iterator: workers started once
    loader.reset()
    list(loader)
    assert loader.iterator is not first
    loader.close()
    del first, loader
    assert_no_leaks(before)


def test_unpatch_restores_ultralytics(yolo_root):
    from ultralytics.data import base, build

    stock_class, stock_reader = build.InfiniteDataLoader, base.BaseDataset.load_image
    fu.patch(fast_decode=True)
    assert fu.is_patched() and build.InfiniteDataLoader is not stock_class
    assert base.BaseDataset.load_image is not stock_reader
    fu.unpatch()
    assert not fu.is_patched()
    assert (build.InfiniteDataLoader, base.BaseDataset.load_image) == (stock_class, stock_reader)


def test_patch_rejects_unknown_options():
    with pytest.raises(TypeError, match="not FastLoader options"):
        fu.patch(num_workers=3)
    assert not fu.is_patched()


def loader_fds():
    """Open pipes (worker queues) and ring slots (memfds) of this process."""
    targets = set()
    for fd in open_fds():
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(("pipe:", "/memfd:fastfeed")):
                targets.add(target)
    return targets


def mosaic_probability(data):
    from ultralytics.data.augment import Mosaic

    stack = [data.transforms]
    while stack:
        transform = stack.pop()
        if isinstance(transform, Mosaic):
            return transform.p
        stack.extend(getattr(transform, "transforms", []))
    return None


def test_yolo_training_runs_on_fastloaders(yolo_root, tmp_path):
    """A real ``model.train()`` from the yaml: two epochs, the second after close_mosaic."""
    from ultralytics import YOLO

    data_yaml = tmp_path / "data.yaml"
    data_yaml.write_text(f"path: {yolo_root}\ntrain: images\nval: images\nnames:\n"
                         + "".join(f"  {i}: {n}\n" for i, n in NAMES.items()))
    before, before_fds = snapshot(), loader_fds()
    fu.patch()
    seen = []
    model = YOLO("yolov8n.yaml")

    def use_workers(trainer):  # Ultralytics sets workers=0 on CPU; a GPU run keeps them
        trainer.args.workers = 2

    def record(trainer):
        seen.append((type(trainer.train_loader), type(trainer.test_loader),
                     trainer.train_loader.num_workers,
                     mosaic_probability(trainer.train_loader.dataset)))

    model.add_callback("on_pretrain_routine_start", use_workers)
    model.add_callback("on_train_epoch_end", record)
    model.train(data=str(data_yaml), epochs=2, imgsz=64, batch=4, workers=2, close_mosaic=1,
                plots=False, device="cpu", amp=False, project=str(tmp_path), name="run",
                verbose=False)
    assert [(issubclass(a, fu.InfiniteFastLoader), issubclass(b, fu.InfiniteFastLoader), *rest)
            for a, b, *rest in seen] == [(True, True, 2, 1.0), (True, True, 2, 0.0)]
    assert (tmp_path / "run" / "weights" / "last.pt").exists()
    del model
    # Ultralytics itself keeps three event fds open after training (so does a stock run):
    # check the loaders' own resources instead.
    assert wait_until(lambda: child_pids() <= before[0] and loader_fds() <= before_fds, 20), (
        child_pids() - before[0], loader_fds() - before_fds)


def test_example_trains_with_the_one_line(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "train_yolo_ultralytics.py"
    out = subprocess.run([sys.executable, str(example), "--epochs", "1", "--fast-decode"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 epochs completed" in out.stdout + out.stderr


# -- the reduced-scale decode ---------------------------------------------------------------

def test_dct_scale_covers_the_output():
    for height, width, imgsz in [(1080, 1920, 640), (1203, 1601, 320), (720, 1280, 640),
                                 (1080, 810, 640), (5000, 37, 64)]:
        size = target_size(height, width, imgsz)
        d = dct_scale(height, width, size)
        assert math.ceil(width / d) >= size[0] and math.ceil(height / d) >= size[1]
        c = 2 * d  # the next coarser scale would not cover the output
        assert d == 8 or math.ceil(width / c) < size[0] or math.ceil(height / c) < size[1]


def load_both(root, i, mode="train", imgsz=320):
    """``load_image(i)`` on two fresh datasets: Ultralytics' reader, then fastfeed's."""
    stock = dataset(root, mode, imgsz)[1].load_image(i)
    fu.patch(fast_decode=True)
    fast = dataset(root, mode, imgsz)[1].load_image(i)
    fu.unpatch()
    return stock, fast


@pytest.mark.parametrize("imgsz", [320, 640])
def test_fast_decode_same_sizes_close_pixels(large_root, imgsz):
    for i in range(6):
        (stock, hw0, hw), (fast, fast_hw0, fast_hw) = load_both(large_root, i, imgsz=imgsz)
        assert (fast_hw0, fast_hw, fast.shape, fast.dtype) == (hw0, hw, stock.shape, stock.dtype)
        assert max(hw0) >= 2 * imgsz
        assert abs(fast.astype(float) - stock.astype(float)).mean() <= 3.0


def test_fast_decode_follows_exif_rotation(tmp_path):
    root = tmp_path / "rotated"
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    make_image(random.Random(0), 1600, 900).save(root / "images" / "a.jpg", exif=exif)
    (root / "labels" / "a.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    (stock, hw0, hw), (fast, fast_hw0, fast_hw) = load_both(root, 0)
    assert hw0 == imread(str(root / "images" / "a.jpg")).shape[:2] == (1600, 900)
    assert (fast_hw0, fast_hw, fast.shape) == (hw0, hw, stock.shape)
    assert abs(fast.astype(float) - stock.astype(float)).mean() <= 3.0


def test_fast_decode_is_exact_below_twice_imgsz(tmp_path):
    """PNGs go to Ultralytics; JPEGs too small to scale decode exactly as Ultralytics does."""
    root = tmp_path / "other"
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    rng = random.Random(0)
    make_image(rng, 1600, 900).save(root / "images" / "a.png")  # not a JPEG
    make_image(rng, 500, 400).save(root / "images" / "b.jpg")  # under twice imgsz
    make_image(rng, 320, 200).save(root / "images" / "c.jpg")  # imgsz already: no resize
    for name in ("a", "b", "c"):
        (root / "labels" / f"{name}.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    for i in range(3):
        stock, fast = load_both(root, i)
        assert_same([torch.from_numpy(stock[0]), stock[1:]], [torch.from_numpy(fast[0]), fast[1:]])


def test_fast_decode_keeps_labels_and_random_draws(large_root):
    """Whole training samples: the same boxes and shapes, images a few grey levels apart."""
    samples = []
    for patched in (False, True):
        if patched:
            fu.patch(fast_decode=True)
        torch.manual_seed(0)
        data = dataset(large_root, imgsz=320)[1]
        random.seed(0)
        np.random.seed(0)
        samples.append([data[i] for i in range(6)])
    for stock, fast in zip(*samples, strict=True):
        assert_same({k: v for k, v in fast.items() if k != "img"},
                    {k: v for k, v in stock.items() if k != "img"})
        assert fast["img"].shape == stock["img"].shape
        assert (fast["img"].float() - stock["img"].float()).abs().mean() <= 3.0


def test_cv2_reduced_decode_is_libjpeg_scaling(large_root):
    """The fast path relies on OpenCV giving ceil(size / d) pixels at 1/d scale."""
    path = str(next((large_root / "images").glob("*.jpg")))
    full = cv2.imread(path)
    for flag, d in [(cv2.IMREAD_REDUCED_COLOR_2, 2), (cv2.IMREAD_REDUCED_COLOR_4, 4)]:
        assert cv2.imread(path, flag).shape[:2] == tuple(math.ceil(s / d) for s in full.shape[:2])
