"""Image pipelines: window decode against Pillow, datasets, YOLO geometry, backends."""

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same
from PIL import Image
from torch.utils.data import DataLoader

from fastfeed import FastLoader
from fastfeed.vision import (
    DecodeError,
    ImageCollate,
    ImageFolder,
    YoloCollate,
    YoloDataset,
    decode_resized_crop,
    image_loader,
    parse_labels,
    roi_decoder_available,
)
from fastfeed.vision.synthetic import make_image, make_imagefolder, make_yolo
from fastfeed.vision.window_decode import image_size, jpeg_frame_size
from fastfeed.vision.yolo import letterbox_boxes


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = make_imagefolder(tmp_path_factory.mktemp("folder"), images=24, classes=3)
    (root / "class_001" / "notes.txt").write_text("not an image")
    nested = root / "class_002" / "nested"
    nested.mkdir()
    make_image(__import__("random").Random(1), 320, 240).save(nested / "deep.JPG", quality=90)
    return root


@pytest.fixture(scope="module")
def yolo(tmp_path_factory):
    return make_yolo(tmp_path_factory.mktemp("yolo"), images=16)


def jpeg_bytes(width=500, height=375, seed=0, quality=90):
    buffer = io.BytesIO()
    make_image(__import__("random").Random(seed), width, height).save(buffer, "JPEG",
                                                                       quality=quality)
    return buffer.getvalue()


def reference_crop(data, box, size):
    """Pillow, full decode (no draft), crop and resize: the ground truth, as CHW."""
    x, y, w, h = box
    with Image.open(io.BytesIO(data)) as image:
        hwc = np.asarray(image.convert("RGB").resize(size, Image.Resampling.BILINEAR,
                                                     box=(x, y, x + w, y + h)))
    return hwc.transpose(2, 0, 1)


@pytest.mark.parametrize("box", [(0, 0, 500, 375), (37, 21, 300, 250), (100, 50, 120, 90),
                                 (10, 10, 480, 360)])
@pytest.mark.parametrize("use_roi", [True, False])
def test_window_decode_matches_full_decode(box, use_roi):
    data = jpeg_bytes()
    got = decode_resized_crop(data, lambda w, h: box, (112, 112), use_roi=use_roi)
    want = reference_crop(data, box, (112, 112))
    assert got.shape == (3, 112, 112) and got.dtype == torch.uint8 and got.is_contiguous()
    # DCT-domain downscaling and iMCU-rounded windows differ from Pillow by a few levels.
    assert np.abs(got.numpy().astype(int) - want.astype(int)).mean() < 4.0


def test_roi_decoder_is_built_here():
    from fastfeed.vision.libjpeg import describe

    # libjpeg-turbo's headers are on this machine and in CI (gpu_suite.sh carries them)
    assert roi_decoder_available(), describe()


def test_image_size_and_non_jpeg():
    data = jpeg_bytes(321, 123)
    assert image_size(data) == (321, 123)
    png = io.BytesIO()
    Image.new("RGB", (40, 30), (10, 20, 30)).save(png, "PNG")
    out = decode_resized_crop(png.getvalue(), lambda w, h: (0, 0, w, h), (8, 6))
    assert out.shape == (3, 6, 8)
    assert torch.equal(out, torch.tensor([10, 20, 30], dtype=torch.uint8).view(3, 1, 1)
                       .expand(3, 6, 8))


def jpeg_variants():
    """JPEGs whose frame header sits behind other segments: EXIF and ICC blocks, progressive
    scans, grey, CMYK, 4:4:4 and 4:2:0, restart markers."""
    image = make_image(__import__("random").Random(3), 333, 217)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: the frame's size is still the stored one
    for mode, options in [("RGB", {}), ("RGB", {"progressive": True}), ("L", {}),
                          ("CMYK", {}), ("RGB", {"subsampling": 0}),
                          ("RGB", {"exif": exif.tobytes(), "icc_profile": b"\0" * 70000}),
                          ("RGB", {"subsampling": 2, "restart_marker_blocks": 4})]:
        buffer = io.BytesIO()
        image.convert(mode).save(buffer, "JPEG", quality=85, **options)
        yield buffer.getvalue()


def test_jpeg_frame_size_is_pillows():
    for data in jpeg_variants():
        with Image.open(io.BytesIO(data)) as image:
            assert jpeg_frame_size(data) == image.size
    # Fill bytes before a marker, and stray bytes between segments, which libjpeg skips (and
    # Pillow refuses).
    data = jpeg_bytes(77, 55)
    assert jpeg_frame_size(data[:2] + b"\xff\xff\xff" + data[2:]) == (77, 55)
    assert jpeg_frame_size(data[:2] + b"junk" + data[2:]) == (77, 55)


@pytest.mark.parametrize("damage", ["png", "no frame", "empty frame", "truncated"])
def test_jpeg_frame_size_refuses_what_has_none(damage):
    data = jpeg_bytes(77, 55)
    frame = data.index(b"\xff\xc0")
    broken = {"png": b"\x89PNG\r\n\x1a\n" + data[8:],
              "no frame": data[:frame] + data[frame + 2 + int.from_bytes(data[frame + 2:frame + 4],
                                                                         "big"):],
              "empty frame": data[:frame + 5] + b"\0\0" + data[frame + 7:],
              "truncated": data[:frame + 6]}[damage]
    with pytest.raises(ValueError):
        jpeg_frame_size(broken)
    with pytest.raises(DecodeError, match=r"cannot read image x\.jpg"):
        image_size(broken, "x.jpg")


@pytest.mark.parametrize("use_roi", [True, False])
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_images_name_the_file(damage, use_roi):
    data = jpeg_bytes()
    broken = data[: len(data) // 2] if damage == "truncated" else b"\xff\xd8" + os.urandom(500)
    with pytest.raises(DecodeError, match=r"broken\.jpg"):
        decode_resized_crop(broken, lambda w, h: (0, 0, w, h), (64, 64), "broken.jpg", use_roi)


def test_imagefolder_layout(folder):
    dataset = ImageFolder(folder, size=32)
    assert dataset.classes == ["class_000", "class_001", "class_002"]
    assert dataset.class_to_idx == {"class_000": 0, "class_001": 1, "class_002": 2}
    files = sorted(str(p) for p in Path(folder).rglob("*") if p.suffix.lower() == ".jpg")
    assert sorted(path for path, _ in dataset.samples) == files
    assert len(dataset) == 25 and dataset.targets.count(2) == 9
    assert dataset.samples[-1][0].endswith(os.path.join("nested", "deep.JPG"))
    image, target = dataset[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.uint8 and target == 0
    with pytest.raises(FileNotFoundError, match="class folder"):
        ImageFolder(folder / "class_000")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_imagefolder_batches_match_torch(folder, num_workers):
    def run(cls):
        loader = cls(ImageFolder(folder, size=48), batch_size=5, shuffle=True,
                     num_workers=num_workers, collate_fn=ImageCollate(),
                     generator=torch.Generator().manual_seed(2))
        torch.manual_seed(0)
        return list(loader)

    expected, got = run(DataLoader), run(FastLoader)
    assert_same(expected, got)
    images, targets = got[0]
    assert images.shape == (5, 3, 48, 48) and images.dtype == torch.uint8
    assert targets.dtype == torch.int64


def test_backends_agree_without_augmentation(folder):
    roi = ImageFolder(folder, size=64, train=False)
    pillow = ImageFolder(folder, size=64, train=False, roi_decode=False)
    for i in range(0, len(roi), 5):
        a, b = roi[i][0].int(), pillow[i][0].int()
        assert (a - b).abs().float().mean() < 4.0, i


def test_skip_corrupt_images_counts_them(folder, tmp_path):
    import shutil

    root = tmp_path / "data"
    shutil.copytree(folder, root)
    victim = next((root / "class_001").glob("*.jpg"))
    victim.write_bytes(victim.read_bytes()[:200])
    strict = FastLoader(ImageFolder(root, size=32), batch_size=4, num_workers=2,
                        collate_fn=ImageCollate())
    with pytest.raises(DecodeError, match=victim.name):
        list(strict)
    lenient = FastLoader(ImageFolder(root, size=32, on_error="skip"), batch_size=4,
                         num_workers=2, collate_fn=ImageCollate())
    total = sum(len(targets) for _, targets in lenient)
    assert total == len(lenient.dataset) - 1
    assert lenient.stats().skipped_samples == 1


def test_parse_labels(tmp_path):
    good = tmp_path / "a.txt"
    good.write_text("0 0.5 0.5 0.2 0.4\n\n3 0.1 0.2 0.3 0.4\n")
    np.testing.assert_allclose(parse_labels(good), [[0, 0.5, 0.5, 0.2, 0.4],
                                                   [3, 0.1, 0.2, 0.3, 0.4]])
    assert parse_labels(tmp_path / "missing.txt").shape == (0, 5)
    bad = tmp_path / "b.txt"
    bad.write_text("0 0.5 0.5 0.2 0.4\n1 0.5 zero 0.2 0.4\n")
    with pytest.raises(ValueError, match=r"b\.txt:2: not a number"):
        parse_labels(bad)
    short = tmp_path / "c.txt"
    short.write_text("1 0.5 0.5\n")
    with pytest.raises(ValueError, match=r"c\.txt:1: expected 5 values"):
        parse_labels(short)


def test_letterbox_boxes_hand_computed():
    # 200×100 into 100: ratio 0.5, resized to 100×50, padded 25 px top and bottom.
    boxes = np.array([[0.5, 0.5, 0.2, 0.4], [0.25, 0.1, 0.1, 0.2]], dtype=np.float32)
    np.testing.assert_allclose(letterbox_boxes(boxes, 200, 100, 100),
                               [[0.5, 0.5, 0.2, 0.2], [0.25, 0.3, 0.1, 0.1]], atol=1e-6)
    # 100×200 (portrait): padded 25 px left and right.
    np.testing.assert_allclose(letterbox_boxes(boxes[:1], 100, 200, 100),
                               [[0.5, 0.5, 0.1, 0.4]], atol=1e-6)


def test_yolo_items_and_flip(yolo):
    plain = YoloDataset(yolo, imgsz=96, train=False)
    flipped = YoloDataset(yolo, imgsz=96, train=True, flip_p=1.0)
    labelled = next(i for i in range(len(plain)) if len(plain[i]["cls"]))
    a, b = plain[labelled], flipped[labelled]
    assert a["img"].shape == (3, 96, 96) and a["bboxes"].shape == (len(a["cls"]), 4)
    assert torch.equal(b["img"], a["img"].flip(-1))
    np.testing.assert_allclose(b["bboxes"][:, 0], 1 - a["bboxes"][:, 0], atol=1e-6)
    np.testing.assert_allclose(b["bboxes"][:, 1:], a["bboxes"][:, 1:])
    assert (a["img"][:, 0, 0] == 114).all() or (a["img"][:, -1, -1] == 114).all()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_yolo_batches_match_torch(yolo, num_workers):
    def run(cls):
        torch.manual_seed(1)
        return list(cls(YoloDataset(yolo, imgsz=64), batch_size=4, num_workers=num_workers,
                        collate_fn=YoloCollate()))

    expected, got = run(DataLoader), run(FastLoader)
    assert_same(expected, got)
    batch = got[0]
    assert batch["img"].shape == (4, 3, 64, 64) and batch["img"].dtype == torch.uint8
    assert batch["cls"].shape[1] == 1 and batch["bboxes"].shape[1] == 4
    assert batch["batch_idx"].shape[0] == batch["cls"].shape[0]


def test_image_loader_cpu_backend(folder, yolo):
    loader = image_loader(folder, batch_size=4, size=32, backend="cpu", num_workers=2)
    images, targets = next(iter(loader))
    assert images.shape == (4, 3, 32, 32) and targets.shape == (4,)
    detect = image_loader(yolo, batch_size=2, task="detect", imgsz=64, num_workers=0)
    assert next(iter(detect))["img"].shape == (2, 3, 64, 64)
    with pytest.raises(ValueError, match="backend"):
        image_loader(folder, batch_size=4, backend="magic")
    with pytest.raises(ValueError, match="nvjpeg"):
        image_loader(folder, batch_size=4, backend="nvjpeg")


@pytest.mark.gpu
def test_nvjpeg_backend_agrees_with_cpu(folder):
    pytest.importorskip("torchvision")
    gpu = image_loader(folder, batch_size=5, size=64, train=False, backend="nvjpeg",
                       device="cuda", num_workers=2)
    cpu = image_loader(folder, batch_size=5, size=64, train=False, backend="cpu",
                       num_workers=2)
    for (a, ta), (b, tb) in zip(gpu, cpu, strict=True):
        assert a.is_cuda and a.shape == b.shape and torch.equal(ta.cpu(), tb)
        assert (a.cpu().int() - b.int()).abs().float().mean() < 6.0


def test_image_collate_takes_chw_tensors_and_hwc_arrays():
    rng = np.random.default_rng(0)
    hwc = [rng.integers(0, 255, (5, 7, 3), dtype=np.uint8) for _ in range(4)]
    chw = [torch.from_numpy(a).permute(2, 0, 1).contiguous() for a in hwc]
    targets = [3, 1, 4, 1]
    from_arrays = ImageCollate()(list(zip(hwc, targets, strict=True)))
    from_tensors = ImageCollate()(list(zip(chw, targets, strict=True)))
    assert_same(from_arrays, from_tensors)
    assert torch.equal(from_tensors[0], torch.stack(chw))


def test_a_cmyk_jpeg_decodes_as_pillow_converts_it_and_draws_its_box_once():
    # ImageNet holds CMYK JPEGs: the window decoder refuses them, Pillow converts them.
    from fastfeed.vision.window_decode import decode_resized_crop, roi_decoder_available

    if not roi_decoder_available():
        pytest.skip("no window decoder here (the libjpeg-turbo extension is not built)")
    rgb = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    encoded = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(encoded, format="JPEG", quality=95)
    calls = []

    def choose_box(width, height):
        calls.append((width, height))
        return 8, 4, 40, 32

    with_window = decode_resized_crop(encoded.getvalue(), choose_box, (20, 16))
    assert len(calls) == 1
    pillow = decode_resized_crop(encoded.getvalue(), choose_box, (20, 16), use_roi=False)
    assert torch.equal(with_window, pillow)


def test_an_empty_class_folder_is_refused_as_torchvision_does(tmp_path):
    root = make_imagefolder(tmp_path / "images", images=4, classes=2)
    (root / "class_empty").mkdir()
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes class_empty"):
        ImageFolder(root)


@pytest.mark.parametrize("load_truncated", [False, True])
def test_a_truncated_jpeg_is_refused_or_loaded_as_pillow_does(load_truncated, monkeypatch):
    # The window decoder never reads below the window: a file cut below it must still be
    # refused, as Pillow (and torchvision) refuse it, or loaded when Pillow is told to.
    from PIL import ImageFile

    from fastfeed.vision.window_decode import DecodeError, decode_resized_crop

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", load_truncated)
    rgb = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    encoded = io.BytesIO()
    Image.fromarray(rgb).save(encoded, format="JPEG", quality=95)
    data = encoded.getvalue()
    cut = data[: len(data) * 2 // 3]

    def top_rows(width, height):  # above the cut: the window decoder alone would load it
        return 0, 0, width, 8

    def whole(width, height):  # across the cut: the window decoder alone would refuse it
        return 0, 0, width, height

    if load_truncated:
        # Loaded as Pillow loads it: the rows above the cut are the image's own.
        intact, loaded = (decode_resized_crop(d, whole, (64, 64)).float() for d in (data, cut))
        assert loaded.shape == (3, 64, 64)
        assert (intact[:, :8] - loaded[:, :8]).abs().mean() < 2
    else:
        with pytest.raises(DecodeError, match="truncated"):
            decode_resized_crop(cut, top_rows, (16, 4))


def test_the_subpackages_are_attributes_of_fastfeed_imported_when_named():
    # The README's `import fastfeed` then `fastfeed.vision.accelerate(ds)`: the subpackages
    # are reachable without an import of their own, and `import fastfeed` alone imports none
    # of them, nor torchvision or Ultralytics (a fresh interpreter: this one has them).
    code = """
import sys
import fastfeed
heavy = ("torchvision", "ultralytics", "cv2", "fastfeed.vision", "fastfeed.ultralytics")
print(sorted(name for name in heavy if name in sys.modules))
accelerate = fastfeed.vision.accelerate
print(accelerate.__module__, fastfeed.ultralytics.patch.__name__, fastfeed.doctor.__name__)
print("vision" in dir(fastfeed))
try:
    fastfeed.nonexistent
except AttributeError as error:
    print(error)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1]).stdout.splitlines()
    assert out == ["[]", "fastfeed.vision.accelerate patch fastfeed.doctor", "True",
                   "module 'fastfeed' has no attribute 'nonexistent'"]
