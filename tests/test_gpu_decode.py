"""The batched crop-resize the GPU decode routes share (``fastfeed.vision.resample``), against
torch's own antialiased ``interpolate`` one crop at a time; its kernel count against the batch
size; and the batch format of encoded crops, on the modelled device (``cuda_model``)."""

from collections import Counter

import cuda_model
import numpy as np
import nvjpeg_model
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fastfeed.vision import resample
from fastfeed.vision.gpu_decode import DecodeCrops, EncodedCrop, collate_crops, encoded_collate
from fastfeed.vision.resample import UINT8, PixelAffine, crop_geometry, resize_crops

aten = torch.ops.aten


def random_images(count, seed=0, smallest=20):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(smallest, 3 * smallest, (count, 2), generator=g).tolist()
    return [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]


def one_at_a_time(image, box, size, flip, mode):
    """torch's interpolate of one crop (Pillow's arithmetic, in float)."""
    x, y, w, h = box
    crop = image[:, y:y + h, x:x + w].unsqueeze(0).float()
    out = F.interpolate(crop, size=(size[1], size[0]), mode=mode, antialias=True,
                        align_corners=False)[0]
    out = out.clamp(0, 255) if mode == "bicubic" else out
    return out.flip(-1) if flip else out


@pytest.mark.parametrize("size", [(24, 16), (64, 80)])  # down- and mostly upscaling
def test_a_batch_equals_each_crop_resized_alone(size):
    images = random_images(6)
    whole = (0, 0, images[1].shape[2], images[1].shape[1])
    boxes = [(1, 2, 15, 18), whole, (5, 3, 9, 7), (2, 2, 17, 12), (3, 1, 19, 19), (0, 4, 6, 13)]
    flips = [False, True, True, False, True, False]
    modes = ["bilinear", "bicubic", "bilinear", "bicubic", "bilinear", "bilinear"]
    geometry = np.stack([crop_geometry(b, size, flip=f, mode=m)
                         for b, f, m in zip(boxes, flips, modes, strict=True)])
    got = resize_crops(images, geometry, PixelAffine(torch.float32))
    assert got.shape == (6, 3, size[1], size[0]) and got.is_contiguous()
    for image, box, flip, mode, resized in zip(images, boxes, flips, modes, got, strict=True):
        torch.testing.assert_close(resized, one_at_a_time(image, box, size, flip, mode),
                                   atol=1e-3, rtol=0)  # a thousandth of a grey level
    rounded = resize_crops(images, geometry)  # uint8: the same, rounded
    assert rounded.dtype == torch.uint8
    assert (rounded.float() - got).abs().max() <= 0.5 + 1e-3


def test_a_crop_of_a_resized_image_reads_the_whole_image():
    # Resize(40) then CenterCrop(24): the window is fractional in the source, and the filter's
    # taps reach outside it, up to the image's edges, as resizing the whole image would.
    image = random_images(1, seed=3, smallest=50)[0]
    height, width = image.shape[1:]
    resized_w, resized_h = 40, round(40 * height / width)
    scale_x, scale_y = width / resized_w, height / resized_h
    left, top = (resized_w - 24) // 2, (resized_h - 24) // 2
    window = (left * scale_x, top * scale_y, 24 * scale_x, 24 * scale_y)
    geometry = crop_geometry(window, (24, 24), bounds=(0, 0, width, height))[None]
    got = resize_crops([image], geometry, PixelAffine(torch.float32))[0]
    whole = F.interpolate(image[None].float(), size=(resized_h, resized_w), mode="bilinear",
                          antialias=True)[0]
    torch.testing.assert_close(got, whole[:, top:top + 24, left:left + 24], atol=2e-3, rtol=0)


def test_conversion_and_normalisation_are_folded_in():
    images = random_images(3, seed=1)
    geometry = np.stack([crop_geometry((0, 0, 12, 10), (8, 8)) for _ in images])
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    affine = PixelAffine(torch.float16, tuple((1 / (255 * std)).tolist()),
                         tuple((-mean / std).tolist()))
    got = resize_crops(images, geometry, affine)
    pixels = resize_crops(images, geometry, PixelAffine(torch.float32))
    want = (pixels / 255 - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=1e-3)
    with pytest.raises(ValueError, match="uint8"):
        PixelAffine(torch.uint8, (2.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="floating"):
        PixelAffine(torch.int32)


def test_a_batch_of_different_output_sizes_is_refused_as_stacking_is():
    images = random_images(2)
    geometry = np.stack([crop_geometry((0, 0, 10, 10), (8, 8)),
                         crop_geometry((0, 0, 10, 10), (8, 9))])
    with pytest.raises(RuntimeError, match="equal size"):
        resize_crops(images, geometry)


class KernelCount(TorchDispatchMode):
    """The ops that compute (a kernel each on a GPU): every aten op but views and aliases."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func in (aten._unsafe_view.default, aten.detach.default)):
            self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def two_sizes(batch, seed=0):
    """Small and large crops, alternating (two groups, neither a run of the batch), bicubic
    (clamped: the most kernels a group takes)."""
    g = torch.Generator().manual_seed(seed)
    images, rows = [], []
    for i in range(batch):
        h, w = (90, 100) if i % 2 else (20, 24)
        images.append(torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g))
        rows.append(crop_geometry((1, 1, w - 3 - i % 3, h - 2 - i % 2), (8, 6), flip=i % 3 == 0,
                                  mode="bicubic"))
    return images, np.stack(rows)


def many_sizes(batch):
    """Crops from 8 to 27,000 pixels wide, bilinear and bicubic: more classes of width and
    filter length than a batch is split into."""
    g = torch.Generator().manual_seed(batch)
    images, rows = [], []
    for i in range(batch):
        w, h = round(8 * 1.3 ** (i % 32)), 4 + 9 * (i % 7)
        images.append(torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g))
        rows.append(crop_geometry((0, 0, w, h), (8, 6), flip=i % 2,
                                  mode="bicubic" if i % 3 else "bilinear"))
    return images, np.stack(rows)


def kernels(images, geometry, affine=UINT8):
    with KernelCount() as count:
        resize_crops(images, geometry, affine)
    return count.ops


@pytest.mark.parametrize("affine", [UINT8, PixelAffine(torch.float32, (0.5,) * 3, (1.0,) * 3)])
def test_the_kernels_of_a_batch_do_not_grow_with_its_size(affine, monkeypatch):
    # A few kernels per group of crops of similar width and filter length, not per crop.
    one_group = [random_images(batch, seed=batch, smallest=24) for batch in (2, 8)]
    counts = [kernels(images, np.stack([crop_geometry((1 + i, 1, 20, 15), (8, 6), flip=i % 2)
                                        for i in range(len(images))]), affine)
              for images in one_group]
    assert counts[0] == counts[1], counts
    assert sum(counts[1].values()) <= 17, counts[1]
    two_groups = [kernels(*two_sizes(batch), affine) for batch in (4, 16)]
    assert two_groups[0] == two_groups[1], two_groups
    # However many classes of crops, at most _MAX_GROUPS groups: a bound whatever the batch,
    # but for the pieces a group is cut into where its float buffers would pass CHUNK_BYTES
    # (crops up to 27,000 pixels wide here): a few kernels a piece, and a piece as large as
    # the memory bound allows.
    per_piece = sum(two_groups[0].values()) / 2
    for batch in (32, 64):
        images, geometry = many_sizes(batch)
        sizes = np.array([i.shape[1:] for i in images])
        with monkeypatch.context() as unbounded:
            unbounded.setattr(resample, "CHUNK_BYTES", 2**62)
            assert len(resample._batch_tables(geometry, sizes)[0]) == resample._MAX_GROUPS
            assert sum(kernels(images, geometry, affine).values()) <= \
                resample._MAX_GROUPS * per_piece
        pieces, tables = resample._batch_tables(geometry, sizes)
        for piece in tables:  # its table (a row per segment), two passes of 3x6 rows, 8x6 crops
            floats = 4 * (len(piece.arrays[0]) * piece.width
                          + piece.size * 3 * 6 * (2 * piece.width + 8))
            assert piece.size == 1 or floats <= resample.CHUNK_BYTES
        assert len(pieces) > resample._MAX_GROUPS
        assert sum(kernels(images, geometry, affine).values()) <= len(pieces) * per_piece


@pytest.fixture
def gpu(monkeypatch):
    return cuda_model.install(monkeypatch, cuda_model.Gpu())


def test_the_resize_waits_for_nothing_and_keeps_to_its_stream(gpu):
    # The tables cross in one asynchronous copy from page-locked memory; everything else is
    # queued on the current stream, and the result is what the CPU computes.
    images = random_images(4, seed=2)
    geometry = np.stack([crop_geometry((2, 3, 14, 11), (9, 7), flip=i % 2) for i in range(4)])
    on_device = [image.pin_memory().to("cuda", non_blocking=True) for image in images]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    queued = len(gpu.default.queue)
    with torch.cuda.stream(side):
        got = resize_crops(on_device, geometry)
    assert gpu.syncs == [] and len(gpu.default.queue) == queued
    assert len(side.queue) >= 10
    gpu.run()
    assert torch.equal(gpu.read(got), resize_crops(images, geometry))


def reserved_by_resize(monkeypatch, images, geometry):
    """The device memory a batch's resize takes: cached blocks are reused per stream as
    torch's allocator does, and the kernels are queued, never run."""
    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(256 << 20))
    on_device = [image.pin_memory().to("cuda", non_blocking=True) for image in images]
    before = gpu.reserved
    resize_crops(on_device, geometry, PixelAffine(torch.float32))
    return gpu.reserved - before


def test_a_large_crop_does_not_pad_the_others(monkeypatch):
    # One table for the batch would pad every crop to the widest one's width and the longest
    # filter (one 4288-pixel photo among ImageNet's: 5-6 GiB for 256 crops that need 0.65):
    # a batch takes no more than its small crops and its large one each take alone.
    small = random_images(16, seed=4, smallest=40)
    large = torch.randint(0, 256, (3, 600, 800), dtype=torch.uint8)
    crops = [crop_geometry((2 + i, 3, 30, 31), (16, 16), flip=i % 2) for i in range(16)]
    whole = crop_geometry((0, 0, 800, 600), (16, 16))
    alone = (reserved_by_resize(monkeypatch, small, np.stack(crops))
             + reserved_by_resize(monkeypatch, [large], whole[None]))
    mixed = reserved_by_resize(monkeypatch, [*small[:9], large, *small[9:]],
                               np.stack([*crops[:9], whole, *crops[9:]]))
    assert mixed <= alone, (mixed, alone)


def test_collated_crops_keep_their_order(gpu, monkeypatch):
    # Files the GPU decodes and crops a worker decoded, interleaved: each image comes back in
    # its place, with its own geometry.
    decoder = nvjpeg_model.install(monkeypatch, gpu)
    import io

    from PIL import Image

    images = random_images(4, seed=5)
    crops, targets = [], []
    for i, image in enumerate(images):
        geometry = crop_geometry((0, 0, image.shape[2], image.shape[1]), (8, 8), flip=i == 1)
        if i % 2:
            resized = resize_crops([image], geometry[None])[0]
            crops.append(EncodedCrop(crop_geometry((0, 0, 8, 8), (8, 8)), pixels=resized))
        else:
            file = io.BytesIO()
            Image.fromarray(image.permute(1, 2, 0).numpy()).save(file, "PNG")  # lossless
            crops.append(EncodedCrop(geometry, data=np.frombuffer(file.getvalue(),
                                                                  np.uint8).copy()))
        targets.append(i)
    batch = collate_crops(crops)
    assert batch["order"].tolist() == [0, -1, 1, -2]
    images_out, got_targets = DecodeCrops(decoder=nvjpeg_model.decode_with_pillow)(
        encoded_collate(list(zip(crops, targets, strict=True))))
    want = torch.stack([resize_crops([image], crop_geometry(
        (0, 0, image.shape[2], image.shape[1]), (8, 8), flip=i == 1)[None])[0]
        for i, image in enumerate(images)])
    assert torch.equal(images_out, want) and got_targets.tolist() == targets
    assert decoder.calls == 0
