"""``accelerate(dataset, decode_device="cuda")`` on the modelled device (``cuda_model``), side
by side with torch's DataLoader over the user's own torchvision dataset.

The decoder is modelled (``nvjpeg_model``): it decodes with Pillow, so what these tests see of
the pixels is the batched resize against Pillow's, not nvJPEG's own decode (measured on a GPU
by ``benchmarks/gpu_decode_pixels.py --device cuda``). The random draws are exact.
"""

import io
import random
import warnings

import cuda_model
import numpy as np
import nvjpeg_model
import pytest
import torch
from clients import import_or_skip

pytestmark = pytest.mark.clients
import_or_skip("torchvision")
import torchvision  # noqa: E402
from helpers import host_syncs_raise  # noqa: E402
from PIL import Image  # noqa: E402
from test_accelerate import MEAN, PIPELINES, STD, Recorder, sample_folder  # noqa: E402
from torch.utils.data import DataLoader, default_collate  # noqa: E402
from torchvision import datasets  # noqa: E402
from torchvision import transforms as T  # noqa: E402

from fastfeed import FastLoader  # noqa: E402
from fastfeed.vision import ImageFolder as FastImageFolder  # noqa: E402
from fastfeed.vision.accelerate import (  # noqa: E402
    BatchTail,
    FusedTransform,
    GpuDecodeTransform,
    accelerate,
    pixel_affine,
)
from fastfeed.vision.gpu_decode import encoded_collate  # noqa: E402
from fastfeed.vision.resample import UINT8, resize_crops  # noqa: E402
from fastfeed.vision.synthetic import make_image  # noqa: E402

ON_GPU = ["v1-train", "v2-train", "v1-eval", "v2-eval", "v1-uint8", "v1-nested",
          "v2-batchable", "reference-train-batchable", "reference-eval", "v1-bicubic",
          "v2-crop-after-flip"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return sample_folder(tmp_path_factory.mktemp("tv"))


@pytest.fixture
def gpu(monkeypatch):
    return cuda_model.install(monkeypatch, cuda_model.Gpu(256 << 20))


@pytest.fixture
def decoder(gpu, monkeypatch):
    return nvjpeg_model.install(monkeypatch, gpu)


def on_gpu(stock):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast = accelerate(stock, decode_device="cuda")
    assert isinstance(fast.transform, GpuDecodeTransform)
    return fast


def grey_levels(images, transform):
    """Floats back to 0–255 grey levels, Normalize undone."""
    images = images.float()
    if not images.dtype.is_floating_point or images.max() > 50:
        return images
    names = repr(getattr(transform, "transforms", transform))
    std = torch.tensor(STD).view(1, 3, 1, 1) if "Normalize" in names else 1.0
    mean = torch.tensor(MEAN).view(1, 3, 1, 1) if "Normalize" in names else 0.0
    return (images * std + mean) * 255


def read(gpu, batches):
    gpu.run()
    return [[gpu.read(leaf) for leaf in batch] for batch in batches]


def assert_close_to_stock(stock_batches, fast_batches, transform, mean=1.0, worst=12.0):
    """Labels exact; pixels within ``mean`` grey levels on average per image and ``worst``
    at any pixel (a different crop window or flip is tens of levels off)."""
    assert len(stock_batches) == len(fast_batches)
    for (images, targets), (fast_images, fast_targets) in zip(stock_batches, fast_batches,
                                                               strict=True):
        assert torch.equal(targets, fast_targets)
        assert fast_images.dtype == images.dtype and fast_images.shape == images.shape
        assert type(fast_images) is torch.Tensor
        difference = (grey_levels(images, transform) - grey_levels(fast_images, transform)).abs()
        assert difference.mean(dim=(1, 2, 3)).max() <= mean, difference.mean(dim=(1, 2, 3))
        assert difference.max() <= worst, difference.max()


@pytest.mark.parametrize("name", ON_GPU)
def test_the_same_draws_as_the_stock_dataloader(name, root, gpu, decoder, monkeypatch):
    """Without workers both loaders draw in this process: the crop windows each side draws
    (recorded), the generators' states after the epoch and the labels are the same; the
    pixels, decoded alike, differ by the resize alone."""
    transform = PIPELINES[name]()
    stock = datasets.ImageFolder(str(root), transform=transform)
    fast = on_gpu(stock)
    recorder = Recorder(monkeypatch)

    def epoch(cls, **device):
        torch.manual_seed(0)
        random.seed(0)
        loader = cls(stock if cls is DataLoader else fast, batch_size=4, shuffle=True,
                     generator=torch.Generator().manual_seed(1), **device)
        batches = list(loader)
        return batches, recorder.take(), torch.get_rng_state(), random.getstate()

    expected, stock_draws, stock_torch, stock_python = epoch(DataLoader)
    got, draws, fast_torch, fast_python = epoch(FastLoader, device="cuda")
    assert draws == stock_draws and torch.equal(fast_torch, stock_torch)
    assert fast_python == stock_python
    assert decoder.calls == len(got), "one decode call a batch"
    assert_close_to_stock(expected, read(gpu, got), transform)


@pytest.mark.parametrize("name", ["v1-train", "reference-train-batchable"])
def test_workers_side_by_side_and_no_wait_on_the_training_thread(name, root, gpu, decoder):
    """With workers (seeded as torch seeds them), two epochs: the batches of torch's
    DataLoader over the user's dataset, decoded on the GPU in the copy's helper thread. The
    training thread never waits for the device; the files are read where the workers wrote
    them."""
    transform = PIPELINES[name]()
    stock = datasets.ImageFolder(str(root), transform=transform)
    kwargs = {"batch_size": 5, "shuffle": True, "num_workers": 2, "persistent_workers": True}
    expected = DataLoader(stock, generator=torch.Generator().manual_seed(3), **kwargs)
    loader = FastLoader(on_gpu(stock), generator=torch.Generator().manual_seed(3),
                        device="cuda", **kwargs)
    first = read(gpu, list(loader))
    assert_close_to_stock(list(expected), first, transform)
    syncs = len(gpu.syncs_in("MainThread"))
    second = list(loader)
    assert gpu.syncs_in("MainThread")[syncs:] == []
    assert all(decoder.read_in_slot[-len(stock) + 2:])  # but the PNG and the CMYK file
    assert_close_to_stock(list(expected), read(gpu, second), transform)


def test_every_epoch_decodes_on_the_one_decode_stream(root, gpu, decoder):
    """Each epoch of non-persistent workers makes its own decode stage. Between two, the user
    (or FSDP, NCCL) takes 30 of torch's 32 pool streams: a decode stream from the pool would
    now be the loader's copy stream, and the decoder's outputs the blocks its last resize
    freed there, kernels still queued. The batches stay stock's, all on one decode stream."""
    transform = PIPELINES["v1-train"]()
    stock = datasets.ImageFolder(str(root), transform=transform)
    kwargs = {"batch_size": 5, "shuffle": True, "num_workers": 2}
    expected = DataLoader(stock, generator=torch.Generator().manual_seed(3), **kwargs)
    loader = FastLoader(on_gpu(stock), generator=torch.Generator().manual_seed(3),
                        device="cuda", **kwargs)
    assert_close_to_stock(list(expected), read(gpu, list(loader)), transform)
    taken = [torch.cuda.Stream() for _ in range(cuda_model.POOL_SIZE - 2)]
    assert_close_to_stock(list(expected), read(gpu, list(loader)), transform)
    made = [stream for stream, _ in gpu.driver.created]  # fastfeed's own: copy, decode
    assert len(set(decoder.streams)) == 1 and set(decoder.streams) <= set(made)
    assert len(made) <= 2
    assert not set(taken) & set(decoder.streams)


class Identity:
    """A user's gpu_transform that does nothing to the batch."""

    def __call__(self, batch):
        return batch


def test_a_users_gpu_transform_keeps_the_decode_off_the_training_thread(root, gpu, decoder):
    """The decode runs on the helper thread with a gpu_transform of the user's after it too
    (the two chained must block the host as the decode alone does)."""
    stock = datasets.ImageFolder(str(root), transform=PIPELINES["v1-train"]())
    loader = FastLoader(on_gpu(stock), batch_size=5, num_workers=2, device="cuda",
                        gpu_transform=Identity())
    batches = list(loader)
    assert batches and gpu.syncs_in("MainThread") == []


def save_jpeg(path, image, **options):
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, "JPEG", **options)


def test_what_nvjpeg_cannot_take_is_decoded_by_the_workers(tmp_path, gpu, decoder):
    rng = random.Random(0)
    save_jpeg(tmp_path / "a" / "0.JPEG", make_image(rng, 120, 90))
    save_jpeg(tmp_path / "a" / "1.JPEG", make_image(rng, 100, 110).convert("CMYK"))
    make_image(rng, 90, 120).save(tmp_path / "a" / "2.JPEG", "PNG")  # ImageNet has one
    save_jpeg(tmp_path / "a" / "3.JPEG", make_image(rng, 130, 100), progressive=True)
    # 100x110 and 90x120 resize to a width under 60: their centre crops pad
    transform = T.Compose([T.Resize(48), T.CenterCrop((48, 60)), T.ToTensor(),
                           T.Normalize(MEAN, STD)])
    stock = datasets.ImageFolder(str(tmp_path), transform=transform)
    got = read(gpu, list(FastLoader(on_gpu(stock), batch_size=4, num_workers=2,
                                    device="cuda")))
    assert_close_to_stock(list(DataLoader(stock, batch_size=4)), got, transform)
    assert decoder.calls == 1 and len(decoder.read_in_slot) == 2  # the baseline and progressive
    data = (tmp_path / "a" / "0.JPEG").read_bytes()
    (tmp_path / "a" / "4.JPEG").write_bytes(data[: len(data) // 2])
    stock = datasets.ImageFolder(str(tmp_path), transform=transform)
    with pytest.raises(OSError, match=r"4\.JPEG"):  # truncated: refused, as Pillow does
        list(FastLoader(on_gpu(stock), batch_size=4, num_workers=2, device="cuda"))


def test_torchvisions_deprecation_of_decode_jpeg_is_silenced_for_the_decode(request):
    """torchvision 0.29 deprecates its decoders and warns at every call: the decode, once a
    batch, silences that warning, and no other, for the process."""
    from fastfeed.vision import jpeg_decoders

    quiet = jpeg_decoders._quiet_torchvision_deprecation
    quiet.cache_clear()  # pytest resets the filters after each test: as a new process
    request.addfinalizer(quiet.cache_clear)
    file = io.BytesIO()
    make_image(random.Random(0), 40, 30).save(file, "JPEG")
    data = torch.frombuffer(bytearray(file.getvalue()), dtype=torch.uint8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torchvision.io.decode_jpeg(data)
        assert [w.category for w in caught if "TorchCodec" in str(w.message)] == \
            [DeprecationWarning], "torchvision warns"
        caught.clear()
        for _ in range(3):
            jpeg_decoders.TorchvisionDecoder()([data], torch.device("cpu"))
        warnings.warn_explicit("another", DeprecationWarning, "image.py", 1,
                               module="torchvision.io.image")
    assert [str(w.message) for w in caught] == ["another"]


def test_files_nvjpeg_refuses_are_decoded_on_the_host(tmp_path, gpu, decoder):
    """One file nvJPEG refuses (torchvision fails the whole call): the batch is still
    stock's. One nothing decodes (no quantisation table: its header passes the workers'
    checks): the error names it."""
    rng = random.Random(1)
    for i in range(4):
        save_jpeg(tmp_path / "a" / f"{i}.JPEG", make_image(rng, 120, 90))
    decoder.refused.add((tmp_path / "a" / "2.JPEG").read_bytes())
    transform = PIPELINES["v1-eval"]()
    stock = datasets.ImageFolder(str(tmp_path), transform=transform)
    got = read(gpu, list(FastLoader(on_gpu(stock), batch_size=4, device="cuda")))
    assert_close_to_stock(list(DataLoader(stock, batch_size=4)), got, transform)
    data = (tmp_path / "a" / "1.JPEG").read_bytes()
    at = data.index(b"\xff\xdb")
    (tmp_path / "a" / "1.JPEG").write_bytes(
        data[:at] + data[at + 2 + int.from_bytes(data[at + 2:at + 4], "big"):])
    stock = datasets.ImageFolder(str(tmp_path), transform=transform)
    with pytest.raises(OSError, match=r"1\.JPEG"):
        list(FastLoader(on_gpu(stock), batch_size=4, num_workers=2, device="cuda"))


@pytest.mark.parametrize(("name", "named"), [
    ("v1-jitter", "PIL image"), ("v1-erasing", "RandomErasing"),
    ("reference-train", "RandomErasing"), ("v1-pil-output", "PIL image"),
    ("v2-trivialaugment", "PIL image")])
def test_what_cannot_run_on_the_gpu_warns_once_and_decodes_on_the_cpu(name, named, root):
    stock = datasets.ImageFolder(str(root), transform=PIPELINES[name]())
    with pytest.warns(UserWarning, match="decode_device") as caught:
        fast = accelerate(stock, decode_device="cuda")
    assert len(caught) == 1 and named in str(caught[0].message)
    assert type(fast.transform) is FusedTransform
    torch.manual_seed(0)
    want = accelerate(stock)[0]
    torch.manual_seed(0)
    assert_same_item(fast[0], want)


def assert_same_item(got, want):
    assert got[1] == want[1]
    if isinstance(want[0], Image.Image):
        assert np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
    else:
        assert torch.equal(got[0], want[0])


def test_read_directly_the_dataset_is_the_cpu_routes(root):
    stock = datasets.ImageFolder(str(root), transform=PIPELINES["v1-train"]())
    fast, cpu = on_gpu(stock), accelerate(stock)
    for index in (0, len(stock) - 1):
        torch.manual_seed(index)
        want = cpu[index]
        torch.manual_seed(index)
        assert_same_item(fast[index], want)


def test_the_option_needs_a_cuda_loader(root, gpu, decoder):
    stock = datasets.ImageFolder(str(root), transform=PIPELINES["v1-train"]())
    fast = on_gpu(stock)
    with pytest.raises(ValueError, match="device='cuda'"):
        iter(FastLoader(fast, batch_size=4))
    with pytest.raises(RuntimeError, match="device='cuda'"):
        next(iter(FastLoader(fast, batch_size=4, device="cpu")))
    with pytest.raises(ValueError, match="decode_device should be 'cuda'"):
        accelerate(stock, decode_device="cpu")
    with pytest.raises(ValueError, match="defer_tail"):
        accelerate(stock, decode_device="cuda", defer_tail=True)
    own = FastImageFolder(root)
    with pytest.warns(UserWarning, match="backend='nvjpeg'"):
        assert accelerate(own, decode_device="cuda") is own


@pytest.mark.parametrize("options", [
    {"batch_size": 4, "collate_fn": lambda items: default_collate(items)},
    {"batch_size": None},
], ids=["own-collate", "no-batching"])
def test_without_torchs_collate_the_workers_decode_and_say_so(options, root, gpu, decoder):
    """The GPU's tail finishes what torch's default collate gives: with anything else, the
    CPU route's items, and a warning (never a silent change of route)."""
    stock = datasets.ImageFolder(str(root), transform=PIPELINES["v1-train"]())
    torch.manual_seed(0)
    want = list(DataLoader(accelerate(stock), **options))
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="made whole in the workers, on the CPU"):
        got = list(FastLoader(on_gpu(stock), device="cuda", **options))
    assert decoder.calls == 0
    gpu.run()
    for batch, expected in zip(got, want, strict=True):
        assert torch.equal(gpu.read(batch[0]), expected[0])
        assert torch.equal(gpu.read(batch[1]) if isinstance(batch[1], torch.Tensor)
                           else torch.tensor(batch[1]), torch.as_tensor(expected[1]))


@pytest.mark.parametrize("name", ON_GPU)
def test_the_folded_tail_is_the_users(name, root):
    """The conversion and elementwise tail, folded into one scale and shift per channel,
    give the user's own objects' values on every grey level."""
    plan = accelerate(datasets.ImageFolder(str(root), transform=PIPELINES[name]())
                      ).transform.plan
    affine = pixel_affine(plan)
    levels = torch.arange(256, dtype=torch.uint8).expand(2, 3, 5, 256).contiguous()
    want = BatchTail(plan)([levels, torch.zeros(2)])[0]
    if affine is UINT8:
        assert torch.equal(want, levels)
        return
    scale = torch.tensor(affine.scale).view(1, 3, 1, 1)
    got = (levels.double() * scale + torch.tensor(affine.offset).view(1, 3, 1, 1))
    assert affine.dtype == want.dtype
    torch.testing.assert_close(got.to(want.dtype), want, atol=1e-5, rtol=1e-5)


def test_timm_transforms_with_an_elementwise_tail(root, gpu, decoder):
    """timm's eval transform, and its train transform without colour jitter, draw with
    Python's random (the crop's interpolation too): the same draws, the same batches."""
    timm_data = pytest.importorskip("timm.data")
    for transform in (timm_data.create_transform(64),
                      timm_data.create_transform(64, is_training=True, color_jitter=None,
                                                 interpolation="random")):
        stock = datasets.ImageFolder(str(root), transform=transform)
        fast = on_gpu(stock)

        def epoch(cls, dataset, **device):
            torch.manual_seed(0)
            random.seed(0)
            batches = list(cls(dataset, batch_size=4, **device))
            return batches, random.getstate(), torch.get_rng_state()

        expected, python, state = epoch(DataLoader, stock)
        got, fast_python, fast_state = epoch(FastLoader, fast, device="cuda")
        assert fast_python == python and torch.equal(fast_state, state)
        assert_close_to_stock(expected, read(gpu, got), transform)


# -- on a GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
def test_on_a_gpu_the_batches_are_stocks_but_for_the_decode(root):
    """nvJPEG decodes, the batched resize runs on the copy stream: labels exact, pixels within
    a few grey levels of Pillow's (nvJPEG's chroma upsampling and IDCT differ from libjpeg's),
    over two epochs with a busy consumer."""
    transform = PIPELINES["v1-train"]()
    stock = datasets.ImageFolder(str(root), transform=transform)
    kwargs = {"batch_size": 5, "shuffle": True, "num_workers": 2, "persistent_workers": True}
    expected = DataLoader(stock, generator=torch.Generator().manual_seed(3), **kwargs)
    loader = FastLoader(on_gpu(stock), generator=torch.Generator().manual_seed(3),
                        device="cuda", **kwargs)
    busy = torch.randn(2048, 2048, device="cuda")
    for _ in range(2):
        got = []
        for images, targets in loader:
            busy = busy @ busy / 2048  # the consumer's stream runs while later batches decode
            got.append([images.clone(), targets])
        torch.cuda.synchronize()
        assert_close_to_stock(list(expected), [[i.cpu(), t.cpu()] for i, t in got], transform,
                              mean=3.0, worst=255.0)


@pytest.mark.gpu
def test_on_a_gpu_the_resize_never_syncs(root):
    stock = datasets.ImageFolder(str(root), transform=PIPELINES["v1-train"]())
    fast = on_gpu(stock)
    crops = fast.transform.split_batch_tail(fast).dataset
    batch = encoded_collate([crops[i] for i in range(8)])[0]
    decoded = torchvision.io.decode_jpeg(
        [torch.from_numpy(data) for data in batch["encoded"]], device="cuda")
    with host_syncs_raise():
        images = resize_crops(decoded, batch["geometry"][batch["order"] >= 0],
                              fast.transform.affine)
    assert images.is_cuda and images.dtype == torch.float32


def test_torchcodec_and_torchvision_decode_a_batch_alike_on_the_cpu(tmp_path):
    """The two decoders behind the GPU decode's seam, run on the CPU (libjpeg-turbo both):
    the same images, so the same batch."""
    pytest.importorskip("torchcodec.decoders")
    from fastfeed.vision.encoded_folder import EncodedImageFolder
    from fastfeed.vision.gpu_decode import DecodeCrops, collate_crops
    from fastfeed.vision.jpeg_decoders import TorchcodecDecoder, TorchvisionDecoder
    from fastfeed.vision.synthetic import make_imagefolder

    folder = EncodedImageFolder(make_imagefolder(tmp_path, images=8, classes=2), 32, train=True)
    crops = collate_crops([folder[i][0] for i in range(8)])
    batches = [DecodeCrops(decoder=decoder()).images(crops)
               for decoder in (TorchcodecDecoder, TorchvisionDecoder)]
    assert torch.equal(*batches)
