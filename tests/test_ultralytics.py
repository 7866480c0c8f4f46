"""``fastfeed.ultralytics`` against Ultralytics' own loaders and image reader, side by side.

Needs Ultralytics (the ``ultralytics`` extra; CI runs this file in its client environment).
"""

import contextlib
import gc
import itertools
import json
import math
import os
import random
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from clients import import_or_skip

pytestmark = pytest.mark.clients
os.environ.setdefault("YOLO_OFFLINE", "1")  # no downloads, no telemetry
import_or_skip("ultralytics")  # missing, or its torchvision built for another torch
import cv2  # noqa: E402
from helpers import assert_same  # noqa: E402
from PIL import Image  # noqa: E402
from procs import assert_no_leaks, loader_processes, open_fds, snapshot, wait_until  # noqa: E402
from ultralytics.cfg import get_cfg  # noqa: E402
from ultralytics.data import build_dataloader, build_yolo_dataset  # noqa: E402
from ultralytics.data.build import seed_worker  # noqa: E402
from ultralytics.utils import DEFAULT_CFG  # noqa: E402
from ultralytics.utils.patches import imread  # noqa: E402

import fastfeed.ultralytics as fu  # noqa: E402
from fastfeed.ultralytics.reduced_decode import dct_scale, target_size  # noqa: E402
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
    # Ultralytics' seed_worker and collate_fn run inside the wrappers that gather the images
    # into the pool slot.
    assert loader.worker_init_fn.init is seed_worker and loader.generator is not None
    assert loader.collate_fn.collate_fn is loader.dataset.collate_fn
    assert loader.worker_init_fn.prepare.__name__ == "prepare_worker"
    assert (loader.num_workers, loader.prefetch_factor, loader.batch_size) == (2, 4, 4)
    assert loader.log_every == 1000 and len(loader) == 6


@pytest.mark.parametrize(("mode", "channels"), [("train", 3), ("val", 3), ("train", 1)])
def test_images_gathered_into_the_slot_equal_stock(yolo_root, mode, channels):
    """Format hands over its (mirrored) HWC view and channel order; SlotCollate gathers them
    transposed into one tensor: the stock batch, byte for byte, with the same random draws
    (grey images too, where Format still draws but never reverses)."""
    from fastfeed.ultralytics.slot_collate import FormattedImage, SlotCollate, format_into_slot

    batches = []
    for prepared in (False, True):
        cfg = get_cfg(DEFAULT_CFG, {"imgsz": 160})
        info = {"names": NAMES, "nc": len(NAMES), "channels": channels}
        data = build_yolo_dataset(cfg, str(yolo_root / "images"), 4, info, mode=mode)
        collate = data.collate_fn
        if prepared:
            format_into_slot(data)
            collate = SlotCollate(collate)
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        samples = [data[i] for i in range(8)]
        if prepared:
            assert all(isinstance(s["img"], FormattedImage) for s in samples)
            # training leaves RandomHSV's jitter of colour images to the gather
            deferred = [s["img"].hsv_table is not None for s in samples]
            assert all(deferred) if (mode, channels) == ("train", 3) else not any(deferred)
            assert "apply_instances" in vars(data.transforms.transforms[-1])  # the lean Format
        batches.append([collate(samples[:4]), collate(samples[4:]), random.random()])
    assert_same(batches[1], batches[0])


def test_lean_format_stays_out_where_format_differs(monkeypatch):
    """The lean Format is probed against the stock one: a Format that normalises or draws
    differently (another Ultralytics version, say) keeps its own methods."""
    from ultralytics.data.augment import Format

    from fastfeed.ultralytics.format import lean_format

    transform = Format()
    assert lean_format(transform) is not None and "apply_instances" in vars(transform)
    with pytest.raises(AssertionError, match="instances are required"):  # as stock says it
        transform.apply_instances({}, {"h": 8, "w": 8, "nl": 0})

    stock_instances = Format.apply_instances
    monkeypatch.setattr(Format, "apply_instances", lambda self, labels, params: {
        **stock_instances(self, labels, params), "extra": torch.zeros(1)})
    transform = Format()
    assert lean_format(transform) is not None and "apply_instances" not in vars(transform)

    stock_img = Format._format_img
    monkeypatch.setattr(Format, "_format_img", lambda self, img: (random.random(),
                                                                  stock_img(self, img))[1])
    assert lean_format(Format()) is None  # draws twice: the marker reads its decision
    assert lean_format(Format(return_mask=True)) is None


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
    """Open pipes (worker queues) and pool slots (memfds) of this process."""
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


def write_data_yaml(root, tmp_path):
    data_yaml = tmp_path / "data.yaml"
    data_yaml.write_text(f"path: {root}\ntrain: images\nval: images\nnames:\n"
                         + "".join(f"  {i}: {n}\n" for i, n in NAMES.items()))
    return data_yaml


@pytest.mark.parametrize("options", [{}, {"augment_device": "cpu"}], ids=["patch", "augment"])
def test_yolo_training_runs_on_fastloaders(yolo_root, tmp_path, options):
    """A real ``model.train()`` from the yaml: two epochs, the second after close_mosaic."""
    from ultralytics import YOLO

    data_yaml = write_data_yaml(yolo_root, tmp_path)
    before, before_fds = snapshot(), loader_fds()
    fu.patch(**options)
    seen = []
    model = YOLO("yolov8n.yaml")

    def use_workers(trainer):  # Ultralytics sets workers=0 on CPU; a GPU run keeps them
        trainer.args.workers = 2

    def record(trainer):
        seen.append((type(trainer.train_loader), type(trainer.test_loader),
                     trainer.train_loader.num_workers,
                     mosaic_probability(trainer.train_loader.dataset),
                     type(trainer.train_loader.gpu_transform).__name__,
                     trainer.test_loader.gpu_transform))

    model.add_callback("on_pretrain_routine_start", use_workers)
    model.add_callback("on_train_epoch_end", record)
    model.train(data=str(data_yaml), epochs=2, imgsz=64, batch=4, workers=2, close_mosaic=1,
                plots=False, device="cpu", amp=False, project=str(tmp_path), name="run",
                verbose=False)
    transform = "PixelOps" if options else "NoneType"
    assert [(issubclass(a, fu.InfiniteFastLoader), issubclass(b, fu.InfiniteFastLoader), *rest)
            for a, b, *rest in seen] == [(True, True, 2, 1.0, transform, None),
                                         (True, True, 2, 0.0, transform, None)]
    assert (tmp_path / "run" / "weights" / "last.pt").exists()
    del model
    # Ultralytics itself keeps three event fds open after training (so does a stock run):
    # check the loaders' own resources instead.
    def released():
        gc.collect()  # the trainer's callbacks hold it in reference cycles
        return loader_processes() <= before[0] and loader_fds() <= before_fds

    assert wait_until(released, 20), (loader_processes() - before[0], loader_fds() - before_fds)


def test_ddp_workers_patch_themselves(yolo_root, tmp_path):
    """Multi-GPU training runs in processes that Ultralytics starts from a script it writes;
    they rebuild the trainer from a pickle, and its callbacks patch them before any loader."""
    pytest.importorskip("cloudpickle")  # Ultralytics' DDP launcher needs it
    from ultralytics.data.base import BaseDataset
    from ultralytics.models.yolo.detect import DetectionTrainer
    from ultralytics.utils import dist

    report = tmp_path / "loader.json"

    def record(trainer):  # pickled by value with the trainer's callbacks
        report.write_text(json.dumps([
            isinstance(trainer.train_loader, fu.InfiniteFastLoader),
            getattr(trainer.train_loader, "fastloader_options", None),
            hasattr(BaseDataset.load_image, "__wrapped__")]))  # fast_decode

    fu.patch(fast_decode=True, log_every=7)
    trainer = DetectionTrainer(overrides={
        "model": "yolov8n.yaml", "data": str(write_data_yaml(yolo_root, tmp_path)),
        "epochs": 1, "imgsz": 64, "batch": 4, "device": "cpu", "amp": False, "plots": False,
        "project": str(tmp_path), "name": "ddp", "verbose": False})
    trainer.add_callback("on_train_start", record)
    script = Path(dist.generate_ddp_file(trainer))
    assert not any(isinstance(c, fu.PatchInWorkers)  # only in the pickle: a later run unpatched
                   for c in trainer.callbacks["on_pretrain_routine_start"])
    fu.unpatch()  # nothing is inherited: the script's process patches itself
    try:
        # Run as one of torchrun's workers would, without torchrun: one process, on the CPU.
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             timeout=600, cwd=tmp_path)
    finally:
        script.unlink()
        script.with_suffix(".pt").unlink()
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(report.read_text()) == [True, {"log_every": 7}, True]


def test_ddp_scripts_without_callbacks_are_named(tmp_path, monkeypatch):
    """Ultralytics releases whose DDP script rebuilds the trainer without its callbacks leave
    the workers unpatched: say so."""
    from ultralytics.utils import dist

    script = tmp_path / "old_ddp.py"
    script.write_text("trainer = DetectionTrainer(cfg=cfg, overrides=overrides)\n")
    monkeypatch.setattr(dist, "generate_ddp_file", lambda trainer: str(script))
    fu.patch()

    class Trainer:
        callbacks = {"on_pretrain_routine_start": []}

        def add_callback(self, event, callback):
            self.callbacks[event].append(callback)

    try:
        with pytest.warns(RuntimeWarning, match="Ultralytics' own loader"):
            assert dist.generate_ddp_file(Trainer()) == str(script)
    finally:
        fu.unpatch()  # before monkeypatch puts Ultralytics' own function back


def test_example_trains_with_the_one_line(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "train_yolo_ultralytics.py"
    out = subprocess.run([sys.executable, str(example), "--epochs", "1", "--fast-decode"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 epochs completed" in out.stdout + out.stderr
    assert "trained on InfiniteFastLoader" in out.stdout  # not Ultralytics' own loader


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


# -- the augmentation on the device (augment_device) ----------------------------------------

def ultralytics_matrix(rng, canvas, size, flip=False):
    """A RandomPerspective matrix as Ultralytics composes it (rotation, scale, shear,
    translation), optionally followed by a left-right flip of the output."""
    c = np.eye(3)
    c[:2, 2] = -canvas / 2
    r = np.eye(3)
    r[:2] = cv2.getRotationMatrix2D(angle=rng.uniform(-30, 30), center=(0, 0),
                                    scale=rng.uniform(0.4, 1.6))
    s = np.eye(3)
    s[0, 1], s[1, 0] = np.tan(np.radians(rng.uniform(-10, 10, 2)))
    t = np.eye(3)
    t[:2, 2] = rng.uniform(0.4, 0.6, 2) * size
    m = (t @ s @ r @ c).astype(np.float32)
    return (np.array([[-1, 0, size - 1], [0, 1, 0], [0, 0, 1]]) @ m) if flip else m


def test_warp_affine_matches_cv2():
    from fastfeed.ultralytics.pixel_ops import warp_affine

    rng = np.random.default_rng(0)
    canvas = np.full((320, 320, 3), 114, np.uint8)
    canvas[:300, :280] = rng.integers(0, 256, (300, 280, 3))  # noise: the hardest case
    matrices = [ultralytics_matrix(rng, 320, 160, flip=i % 2 == 1) for i in range(6)]
    expected = np.stack([cv2.warpAffine(canvas, m[:2], dsize=(160, 160),
                                        borderValue=(114, 114, 114, 114)) for m in matrices])
    got = warp_affine(torch.from_numpy(canvas).expand(6, -1, -1, -1).contiguous(),
                      torch.from_numpy(np.stack([m[:2] for m in matrices])), (160, 160)).numpy()
    assert got.shape == expected.shape
    assert np.array_equal(got, expected), (got != expected).mean()


def axis_aligned_cases(rng, count):
    """Images, scale-and-translate matrices and sizes: zoom in and out, unequal scales, mirrored
    columns, rows with padding between them or in reverse order, outputs that run past every
    edge."""
    for i in range(count):
        h, w = (int(v) for v in rng.integers(40, 900, 2))
        image = rng.integers(0, 256, (h, w + 5 * (i % 2), 3), dtype=np.uint8)[:, :w]
        image = image[::-1] if i % 4 == 3 else image
        sx = rng.uniform(0.3, 2.0)
        sy = sx if i % 3 else rng.uniform(0.3, 2.0)
        tx = rng.uniform(-1200, 600)
        if i % 5 == 4:  # mirrored: output column tx - sx * x shows source column x
            sx, tx = -sx, sx * w + tx / 4
        matrix = np.array([[sx, 0, tx], [0, sy, rng.uniform(-1200, 600)], [0, 0, 1]],
                          np.float32)
        yield image, matrix, (32 * int(rng.integers(1, 25)), int(rng.integers(1, 500)))


@pytest.mark.skipif(cv2.__version__ < "5", reason="OpenCV 4 warps in fixed point")
def test_axis_aligned_warp_is_opencvs_to_the_bit():
    from fastfeed.ultralytics.warp import matches_opencv, warp_axis_aligned

    assert matches_opencv()
    for image, matrix, size in axis_aligned_cases(np.random.default_rng(0), 40):
        expected = cv2.warpAffine(image, matrix[:2], dsize=size, borderValue=(114,) * 4)
        assert np.array_equal(warp_axis_aligned(image, matrix, size), expected), (
            image.shape, matrix, size)


def test_shrink_linear_is_within_a_level_of_cv2_resize():
    """cv2.resize's sampling positions with float weights: any width, unequal factors, a
    strided image, the same size; enlargements are left to cv2."""
    from fastfeed.ultralytics.warp import shrink_linear

    rng = np.random.default_rng(2)
    for case in range(12):
        h, w = (int(v) for v in rng.integers(20, 700, 2))
        image = rng.integers(0, 256, (h, 2 * w, 3), dtype=np.uint8)[:, :w]
        size = (int(rng.integers(1, w + 1)), int(rng.integers(1, h + 1))) if case else (w, h)
        expected = cv2.resize(image, size, interpolation=cv2.INTER_LINEAR)
        got = shrink_linear(image, size)
        assert got is not None and got.shape == expected.shape, (image.shape, size)
        assert np.abs(got.astype(int) - expected).max() <= 1, (image.shape, size)
    assert shrink_linear(image, (w + 1, h)) is None and shrink_linear(image, (w, h + 1)) is None


@pytest.mark.skipif(cv2.__version__ < "5", reason="OpenCV 4 warps in fixed point")
def test_mosaic_warped_from_its_four_images_is_the_canvas_warped():
    """The kernel reads a pending mosaic from its four images (grey between them, rows and
    columns cut by the canvas, a strided image): cv2.warpAffine of the laid-out canvas."""
    from fastfeed.ultralytics.mosaic import PendingCanvas, Placement
    from fastfeed.ultralytics.warp import _run_tiles, _tile

    rng = np.random.default_rng(1)
    for case, (image, matrix, size) in enumerate(axis_aligned_cases(rng, 12)):
        side = 64 + 16 * case
        centre_y, centre_x = (int(v) for v in rng.integers(side // 4, 3 * side // 4, 2))
        placements = []
        for quadrant in range(4):
            h, w = (int(v) for v in rng.integers(8, side, 2))
            tile = rng.integers(0, 256, (h, 2 * w, 3), dtype=np.uint8)[:, ::2]  # strided rows
            tile = np.ascontiguousarray(tile) if quadrant % 2 else tile[:, :w].copy()
            y1 = max(centre_y - h, 0) if quadrant < 2 else centre_y
            x1 = max(centre_x - w, 0) if quadrant % 2 == 0 else centre_x
            y2, x2 = min(y1 + h, side), min(x1 + w, side)
            placements.append(Placement(tile, y1, y2, x1, x2, h - (y2 - y1), 0))
        pending = PendingCanvas(np.broadcast_to(np.uint8(114), (side, side, 3)),
                                tuple(placements))
        scale = side / image.shape[0]
        warp = matrix.copy()
        warp[:2] *= [[scale, 1, scale], [1, scale, scale]]
        expected = cv2.warpAffine(pending.render(), warp[:2], dsize=size, borderValue=(114,) * 4)
        tiles = [_tile(p.pixels(), p.y1, p.x1) for p in placements]
        assert np.array_equal(_run_tiles(tiles, (side, side), warp, size, 114), expected), case


def test_other_warps_are_left_to_opencv(monkeypatch):
    from ultralytics.data.augment import RandomPerspective

    from fastfeed import _warp
    from fastfeed.ultralytics.warp import exact_warp, warp_axis_aligned

    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, (200, 300, 3), dtype=np.uint8)
    scale = np.array([[0.9, 0, 10], [0, 0.9, -5]], np.float32)
    for bad_image, matrix, size in [
        (image, cv2.getRotationMatrix2D((0, 0), 10, 0.9).astype(np.float32), (64, 64)),
        (image, np.array([[0.9, 0.1, 0], [0, 0.9, 0]], np.float32), (64, 64)),  # shear
        (image, scale, (60, 64)),  # width not a multiple of 32
        (image[..., :1].copy(), scale, (64, 64)),
        (image[:, ::2], scale, (64, 64)),  # pixels not contiguous
    ]:
        with pytest.raises(ValueError):
            warp_axis_aligned(bad_image, matrix, size)
        monkeypatch.setattr(_warp, "warp_axis_aligned", None)  # taking the kernel would fail
        warp = exact_warp(RandomPerspective.apply_image)
        transform = RandomPerspective()
        labels = warp(transform, {"img": bad_image}, {"M": matrix, "size": size})
        expected = cv2.warpAffine(bad_image, matrix[:2], dsize=size, borderValue=(114,) * 4)
        assert np.array_equal(labels["img"].reshape(expected.shape), expected)
        monkeypatch.undo()


def test_patched_training_takes_the_separable_warp(yolo_root, monkeypatch):
    from ultralytics.data import augment

    from fastfeed import _warp

    stock = augment.RandomPerspective.apply_image
    calls = []
    kernel = _warp.warp_axis_aligned
    monkeypatch.setattr(_warp, "warp_axis_aligned", lambda *a: calls.append(a) or kernel(*a))
    fu.patch()
    assert augment.RandomPerspective.apply_image is not stock
    _, data = dataset(yolo_root)
    data[0]
    assert len(calls) == 1
    fu.unpatch()
    assert augment.RandomPerspective.apply_image is stock


def test_hsv_conversions_match_cv2():
    from fastfeed.ultralytics.gpu_augment import opencv_hsv_truncates
    from fastfeed.ultralytics.pixel_ops import bgr_to_hsv, hsv_to_bgr

    rng = np.random.default_rng(1)
    bgr = rng.integers(0, 256, (64, 640, 3), dtype=np.uint8)
    assert np.array_equal(bgr_to_hsv(torch.from_numpy(bgr)).numpy(),
                          cv2.cvtColor(bgr, cv2.COLOR_BGR2HSV))
    hsv = np.stack([rng.integers(0, 180, (64, 640)), rng.integers(0, 256, (64, 640)),
                    rng.integers(0, 256, (64, 640))], -1).astype(np.uint8)
    expected = cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)
    got = hsv_to_bgr(torch.from_numpy(hsv), truncate=opencv_hsv_truncates()).numpy()
    assert np.array_equal(got, expected), (got != expected).mean()


def test_hsv_lookup_matches_random_hsv():
    """The same numpy draws: Ultralytics' RandomHSV on each image against the batch op."""
    from ultralytics.data.augment import RandomHSV

    from fastfeed.ultralytics.gpu_augment import opencv_hsv_truncates
    from fastfeed.ultralytics.hsv import draw_lut
    from fastfeed.ultralytics.pixel_ops import hsv_lookup

    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (4, 32, 96, 3), dtype=np.uint8)
    hsv = RandomHSV(hgain=0.015, sgain=0.7, vgain=0.4)
    np.random.seed(0)
    expected = np.stack([hsv({"img": image.copy()})["img"] for image in images])
    np.random.seed(0)
    luts = torch.from_numpy(np.stack([draw_lut(hsv) for _ in images]))
    got = hsv_lookup(torch.from_numpy(images), luts, torch.tensor([True, True, True, False]),
                     opencv_hsv_truncates()).numpy()
    assert np.array_equal(got[3], images[3])
    assert np.array_equal(got[:3], expected[:3])


def test_device_augmentation_keeps_labels_and_pixels(yolo_root):
    """Through Ultralytics' build_dataloader, two epochs, close_mosaic + reset(), a third:
    with the ops on the CPU, every label and every image equal to stock's."""
    _, stock = epochs_with_close_mosaic(yolo_root)
    fu.patch(augment_device="cpu")
    fast_type, fast = epochs_with_close_mosaic(yolo_root)
    assert fast_type.augment_device == "cpu"
    batches = zip(itertools.chain(*stock), itertools.chain(*fast), strict=True)
    for stock_batch, fast_batch in batches:
        assert_same({k: v for k, v in fast_batch.items() if k != "img"},
                    {k: v for k, v in stock_batch.items() if k != "img"})
        s, f = stock_batch["img"], fast_batch["img"]
        assert f.dtype == s.dtype and f.shape == s.shape and f.is_contiguous()
        assert torch.equal(f, s), ((f != s).float().mean(), (f.int() - s.int()).abs().max())


def test_device_augmentation_leaves_other_pipelines_on_the_cpu(yolo_root):
    from ultralytics.data.augment import MixUp

    from fastfeed.ultralytics.gpu_augment import defer_pixel_ops, unsupported_reason

    fu.patch(augment_device="cpu")
    train = dataset(yolo_root)[1]
    assert unsupported_reason(train) is None
    val = dataset(yolo_root, mode="val")[1]
    assert "does not augment" in unsupported_reason(val)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the validation loader stays put without a word
        build_dataloader(val, 4, 2, shuffle=False, rank=-1).close()
    mixup = next(t for t in train.transforms.transforms if isinstance(t, MixUp))
    mixup.p = 0.5
    assert "MixUp changes pixels" in unsupported_reason(train)
    with pytest.raises(ValueError, match="MixUp"):
        defer_pixel_ops(train)
    with pytest.warns(RuntimeWarning, match="stays on the CPU: MixUp"):
        loader = build_dataloader(train, 4, 2, shuffle=True, rank=-1)
    assert loader.device is None and loader.gpu_transform is None
    loader.close()


def test_augment_device_needs_worker_processes_and_a_device_of_this_machine():
    with pytest.raises(ValueError, match="worker processes"):
        fu.patch(augment_device="cuda", worker_mode="thread")
    with pytest.raises(ValueError, match="sets the loader's device"):
        fu.patch(augment_device="cuda", device="cuda")
    with pytest.raises(ValueError, match="not a valid torch device"):
        fu.patch(augment_device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            fu.patch(augment_device="cuda")
    assert not fu.is_patched()


def test_pixel_ops_benchmark_runs(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "ultralytics_pipeline.py"
    out = subprocess.run([sys.executable, str(script), "--ops-device", "cpu", "--imgsz", "64",
                          "--batch-size", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ms per batch" in out.stdout


def test_training_stall_benchmark_runs(tmp_path):
    """As on the GPU machine, which has no polars (Ultralytics' training imports it)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "yolo_train_stall.py"
    (tmp_path / "polars").mkdir()
    (tmp_path / "polars" / "__init__.py").write_text("raise ImportError('no polars here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(tmp_path), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(script), "--images", "8", "--widths", "320,400",
                          "--imgsz", "64", "--batch-size", "4", "--workers", "2", "--device",
                          "cpu", "--epochs", "1", "--repeats", "1", "--configs", "stock,patched",
                          "--project", str(tmp_path / "runs")], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| patched |" in out.stdout and "data stall" in out.stdout


# -- the one-pass HSV jitter ------------------------------------------------------------------

def opencv_hsv(image, lut):
    out = image.copy()
    hsv = cv2.cvtColor(out, cv2.COLOR_BGR2HSV)
    cv2.cvtColor(cv2.LUT(hsv, np.ascontiguousarray(lut.T).reshape(1, 256, 3)),
                 cv2.COLOR_HSV2BGR, dst=out)
    return out


@pytest.mark.skipif(cv2.__version__ < "5", reason="OpenCV 4 rounds HSV->BGR")
def test_hsv_kernel_is_opencvs_on_every_colour():
    """All 2^24 BGR colours, rows of 640 pixels, under tables Ultralytics draws (whose entries
    the kernel computes) and under a table of random entries (which it gathers)."""
    from ultralytics.data.augment import RandomHSV

    from fastfeed.ultralytics.hsv import draw_lut, hsv_jitter, matches_opencv

    assert matches_opencv()
    every = np.arange(1 << 24, dtype=np.uint32)
    colours = np.stack([every >> 16, (every >> 8) & 255, every & 255], -1).astype(np.uint8)
    image = np.resize(colours, (26215 * 640, 3)).reshape(26215, 640, 3)
    np.random.seed(0)
    drawn = [draw_lut(RandomHSV(*gains)) for gains in [(0.015, 0.7, 0.4), (0.5, 0.5, 0.5)]]
    scattered = np.random.default_rng(0).integers(0, 256, (3, 256), dtype=np.uint8)
    scattered[0] %= 180  # hues stay hues, as in any table cv2.LUT is given for HSV
    for lut in [*drawn, scattered]:
        got = image.copy()
        hsv_jitter(got, lut)
        assert np.array_equal(got, opencv_hsv(image, lut))


def test_the_kernel_computes_every_table_ultralytics_draws():
    """A table's entries are computed rather than gathered only where arithmetic gives every
    one of them; every table RandomHSV draws, at its default gains and at the largest, is such
    a table, and one that maps 1 above 2, in any row, is not."""
    from ultralytics.data.augment import RandomHSV

    from fastfeed.ultralytics.hsv import _hsv, draw_lut

    np.random.seed(7)
    for gains in [(0.015, 0.7, 0.4), (1.0, 1.0, 1.0), (0.0, 0.7, 0.0)]:
        transform = RandomHSV(*gains)
        for _ in range(500):
            table = draw_lut(transform)
            assert _hsv.computes_table(table.ctypes.data), (gains, table)
            for row in range(3):
                changed = table.copy()
                changed[row, 1] = changed[row, 2] + 1
                assert not _hsv.computes_table(changed.ctypes.data)


def test_hsv_jitter_keeps_ultralytics_bytes_and_draws():
    """Through RandomHSV itself: the kernel's widths and OpenCV's (a width that is not a
    multiple of 32, a grey image), with the same numpy draws."""
    from ultralytics.data.augment import RandomHSV

    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (48, 640, 3), dtype=np.uint8),
              rng.integers(0, 256, (40, 100, 3), dtype=np.uint8),
              rng.integers(0, 256, (40, 64, 1), dtype=np.uint8)]
    outputs = []
    for patched in (False, True):
        if patched:
            fu.patch()
        np.random.seed(0)
        transform = RandomHSV(0.015, 0.7, 0.4)
        outputs.append([transform({"img": image.copy()})["img"] for image in images]
                       + [np.random.random()])
    assert_same(outputs[1], outputs[0])


def test_gather_jittered_is_the_jitter_then_the_gather():
    """Mirrored views either way, both channel orders, images without a table, and a width
    that leaves a scalar tail, against hsv_jitter in place and a transposing copy."""
    from ultralytics.data.augment import RandomHSV

    from fastfeed.collate import torch_empty
    from fastfeed.ultralytics.hsv import draw_lut, gather_jittered, hsv_jitter

    rng = np.random.default_rng(5)
    np.random.seed(5)
    for width in (64, 40, 37):  # 40 and 37: AVX-512, then AVX2 or scalar pixels
        images = [rng.integers(0, 256, (24, width, 3), dtype=np.uint8) for _ in range(6)]
        tables = [draw_lut(RandomHSV(0.5, 0.5, 0.5)) if i % 3 else None for i in range(6)]
        views, reverse, expected = [], [], []
        for i, (image, table) in enumerate(zip(images, tables, strict=True)):
            jittered = image.copy()
            if table is not None:  # a 64-wide copy: the kernel's vector path for every pixel
                padded = np.zeros((24, 64, 3), np.uint8)
                padded[:, :width] = image
                hsv_jitter(padded, table)
                jittered = padded[:, :width]
            flip = (slice(None, None, -1 if i % 2 else 1), slice(None, None, -1 if i > 2 else 1))
            views.append(image[flip])
            reverse.append(i in (1, 4))
            chw = jittered[flip].transpose(2, 0, 1)
            expected.append(chw[::-1] if reverse[-1] else chw)
        got = gather_jittered(views, tables, torch_empty, reverse)
        assert np.array_equal(got.numpy(), np.stack(expected))


def test_deferred_jitter_refuses_another_image():
    """A table held for one image is never applied to another: a transform that replaced the
    image between RandomHSV and Format is an error, not silently unjittered pixels."""
    from fastfeed.ultralytics.hsv import DeferredJitter

    image, other = np.zeros((4, 32, 3), np.uint8), np.zeros((4, 32, 3), np.uint8)
    deferred = DeferredJitter()
    deferred.hold(image, np.zeros((3, 256), np.uint8))
    assert deferred.take(np.fliplr(np.flipud(image))) is not None
    assert deferred.take(image) is None  # taken once
    deferred.hold(image, np.zeros((3, 256), np.uint8))
    with pytest.raises(RuntimeError, match="not the one RandomHSV jittered"):
        deferred.take(other)


# -- one image cache per machine (patch(cache="shared")) --------------------------------------

RANK = """
import hashlib, json, os, sys
os.environ["YOLO_OFFLINE"] = "1"
from ultralytics.cfg import get_cfg
from ultralytics.data import base, build_yolo_dataset
from ultralytics.utils import DEFAULT_CFG
import fastfeed.ultralytics as fu

fu.patch(cache="shared")
decoded = []
imread = base.imread
base.imread = lambda *args, **kwargs: decoded.append(1) or imread(*args, **kwargs)
cfg = get_cfg(DEFAULT_CFG, {"imgsz": 160, "cache": "ram"})
info = {"names": {i: str(i) for i in range(8)}, "nc": 8, "channels": 3}
data = build_yolo_dataset(cfg, sys.argv[1], 4, info, mode="train")
images = [data.load_image(i) for i in range(len(data))]
digest = hashlib.sha256(b"".join(i.tobytes() + repr(hw).encode() for i, hw, _ in images))
path = str(data.ims.path)
memory, inside = {}, False
for line in open("/proc/self/smaps"):
    key, _, value = line.partition(":")
    if " " in key:  # a mapping's first line: "start-end perms offset dev inode path"
        inside = line.rstrip().endswith(path)
    elif inside and value.strip().endswith("kB"):
        memory[key] = memory.get(key, 0) + int(value.split()[0])
print("report:", json.dumps({"path": path, "decoded": len(decoded), "memory": memory,
                  "digest": digest.hexdigest(),
                  "image_bytes": sum(i.nbytes for i, _, _ in images)}), flush=True)
sys.stdin.readline()  # keep the mapping until the test has measured both processes
"""


def images_digest(images):
    import hashlib

    return hashlib.sha256(b"".join(i.tobytes() + repr(hw).encode() for i, hw, _ in images)
                          ).hexdigest()


def test_shared_cache_serves_two_ranks_from_one_copy(yolo_root):
    """Two processes, as two DDP ranks: the first decodes every image, the second none; both
    map the same pages (the second's proportional share is half of what it maps, nothing is
    private), the file is the images' size, its images are Ultralytics' cache="ram" ones,
    and it is gone when both have exited."""
    from fastfeed.ultralytics.shared_cache import cache_dir

    before = set(cache_dir().glob("fastfeed-yolo-*"))
    cfg = get_cfg(DEFAULT_CFG, {"imgsz": 160, "cache": "ram"})
    info = {"names": NAMES, "nc": len(NAMES), "channels": 3}
    stock = build_yolo_dataset(cfg, str(yolo_root / "images"), 4, info, mode="train")
    expected = images_digest([stock.load_image(i) for i in range(len(stock))])
    ranks, reports = [], []
    try:
        for _ in range(2):
            rank = subprocess.Popen([sys.executable, "-c", RANK, str(yolo_root / "images")],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            ranks.append(rank)
            line = ""
            while not line.startswith("report:"):  # after Ultralytics' own log lines
                line = rank.stdout.readline()
                assert line, "the rank exited early"
            reports.append(json.loads(line.removeprefix("report:")))
    finally:
        for rank in ranks:
            rank.communicate("go\n", timeout=60)
    first, second = reports
    assert [first["decoded"], second["decoded"]] == [len(stock), 0]
    assert first["digest"] == second["digest"] == expected
    assert first["path"] == second["path"]
    memory = second["memory"]
    assert memory["Private_Clean"] == memory["Private_Dirty"] == 0
    assert memory["Rss"] * 1024 >= second["image_bytes"]
    assert memory["Pss"] <= memory["Rss"] / 2 + 4  # every page shared with the first rank
    assert memory["Size"] * 1024 < second["image_bytes"] + 64 * 1024  # one copy, no slack
    assert set(cache_dir().glob("fastfeed-yolo-*")) == before


def test_shared_cache_batches_equal_ram_cache(yolo_root):
    """Training batches through build_dataloader, with workers: Ultralytics' cache="ram"
    against patch(cache="shared") (Mosaic draws from the whole dataset in both)."""
    runs = []
    for patched in (False, True):
        if patched:
            fu.patch(cache="shared")
        torch.manual_seed(0)
        cfg = get_cfg(DEFAULT_CFG, {"imgsz": 160, "cache": "ram"})
        data = build_yolo_dataset(cfg, str(yolo_root / "images"), 4,
                                  {"names": NAMES, "nc": len(NAMES), "channels": 3}, mode="train")
        loader = build_dataloader(data, 4, 2, shuffle=True, rank=-1)
        runs.append([list(loader), list(loader)])
        loader.close()
        if patched:
            data.ims.close()
    assert_same(runs[1], runs[0])


def test_shared_cache_over_budget_says_so_and_decodes(yolo_root):
    from fastfeed.ultralytics.shared_cache import cache_dir

    before = set(cache_dir().glob("fastfeed-yolo-*"))
    fu.patch(cache="shared", cache_budget_gib=1e-4)
    cfg = get_cfg(DEFAULT_CFG, {"imgsz": 160, "cache": "ram"})
    with pytest.warns(RuntimeWarning, match=r"shared image cache is off: 24 images need"):
        data = build_yolo_dataset(cfg, str(yolo_root / "images"), 4,
                                  {"names": NAMES, "nc": len(NAMES), "channels": 3},
                                  mode="train")
    assert data.cache is None and data.ims[0] is None
    assert set(cache_dir().glob("fastfeed-yolo-*")) == before
    with pytest.raises(ValueError, match="cache must be"):
        fu.patch(cache="ram")


@pytest.mark.parametrize("scale", [0.5, 0.95])
def test_lazy_mosaic_gives_stock_samples(yolo_root, scale):
    """Workers lay out only the part of each mosaic canvas the warp reads: the same batches
    and random draws as stock, at Ultralytics' default scale jitter and at one that zooms far
    out (most of the canvas read) and far in."""
    from ultralytics.data.augment import Mosaic

    from fastfeed.ultralytics.infinite_loader import prepare_worker
    from fastfeed.ultralytics.slot_collate import SlotCollate, flatten

    batches = []
    for patched in (False, True):
        if patched:
            fu.patch()
        cfg = get_cfg(DEFAULT_CFG, {"imgsz": 160, "scale": scale})
        data = build_yolo_dataset(cfg, str(yolo_root / "images"), 4,
                                  {"names": NAMES, "nc": len(NAMES), "channels": 3}, mode="train")
        collate = data.collate_fn
        if patched:
            prepare_worker(data)
            assert all(getattr(t, "_fastfeed_defers_canvas", False)
                       for t in flatten(data.transforms) if type(t) is Mosaic)
            collate = SlotCollate(collate)
        random.seed(0)
        np.random.seed(0)
        batches.append([collate([data[i % len(data)] for i in range(b, b + 4)])
                        for b in range(0, 48, 4)] + [random.random()])
    assert_same(batches[1], batches[0])


def test_label_copies_are_deep_copies(yolo_root):
    """copy_labels gives what copy.deepcopy gives for every label dict, shares no array with
    it, keeps aliases aliased, and leaves other values to deepcopy."""
    import copy

    from fastfeed.ultralytics.labels import copy_labels

    labels = dataset(yolo_root)[1].labels
    for label in labels:
        copied = copy_labels(label)
        assert_same(copied, copy.deepcopy(label))
        pairs = zip(copied.values(), label.values(), strict=True)
        assert not any(np.shares_memory(a, b) for a, b in pairs if isinstance(a, np.ndarray))
    shared = np.arange(4.0)
    odd = {"a": shared, "b": [shared, (1, "x")], "c": {1, 2}, "d": np.array([None])}
    copied = copy_labels(odd)
    assert copied["a"] is copied["b"][0] and copied["a"] is not shared
    assert copied["c"] == {1, 2} and copied["c"] is not odd["c"] and copied["d"] is not odd["d"]


KERNEL_EXACTNESS = ("test_axis_aligned_warp_is_opencvs_to_the_bit",
                    "test_mosaic_warped_from_its_four_images_is_the_canvas_warped",
                    "test_hsv_kernel_is_opencvs_on_every_colour",
                    "test_gather_jittered_is_the_jitter_then_the_gather")


def test_the_kernels_avx2_paths_give_the_same_bytes():
    """The warp's and the jitter's exactness tests again under FASTFEED_ISA=avx2: a CPU with
    AVX-512 then runs the AVX2 paths that every AVX2-only CPU runs (which this CPU runs
    either way)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
         *(f"{__file__}::{name}" for name in KERNEL_EXACTNESS)],
        env={**os.environ, "FASTFEED_ISA": "avx2"}, capture_output=True, text=True,
        timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
