"""The nvjpeg backend on the modelled device (``cuda_model``), its decoder modelled on what
torchvision's CUDA code does (``decode_jpegs_cuda.cpp``): outputs allocated on the current
stream, written on a private stream the host synchronises (twice a batch), and in ``UNCHANGED``
mode a greyscale image cloned on the current stream. The pixels each batch ends with are
compared with the same crops decoded on the CPU. (On a GPU: the ``gpu`` tests below.)"""

import enum
import io
import pickle
import sys
import types

import cuda_model
import numpy as np
import pytest
import torch
from PIL import Image

from fastfeed import FastLoader
from fastfeed.tree import map_tensors
from fastfeed.vision import ImageFolder
from fastfeed.vision.nvjpeg import (
    EncodedImageFolder,
    NvjpegDecode,
    crop_resize,
    encoded_collate,
    gpu_decodable,
    nvjpeg_transform,
)
from fastfeed.vision.synthetic import make_imagefolder


class ImageReadMode(enum.Enum):
    UNCHANGED, GRAY, RGB = 0, 1, 3


def decode_with_pillow(data, device=None, mode=ImageReadMode.RGB):
    """torchvision.io.decode_jpeg's contract on the CPU: a list of C×H×W uint8."""
    images = []
    for item in data:
        image = Image.open(io.BytesIO(np.asarray(item).tobytes()))
        if mode is ImageReadMode.RGB or image.mode != "L":
            image = image.convert("RGB")
        array = np.asarray(image)
        images.append(torch.from_numpy(array.reshape(*array.shape[:2], -1).copy())
                      .permute(2, 0, 1).contiguous())
    return images


class TorchvisionDecoder:
    """``torchvision.io.decode_jpeg(device="cuda")`` as decode_jpegs_cuda.cpp runs it."""

    def __init__(self, gpu):
        self.gpu = gpu
        self.private = None  # the decoder's stream, from torch's pool at first use
        self.read_in_slot = []  # per encoded file: read where the worker left it

    def __call__(self, data, device=None, mode=ImageReadMode.UNCHANGED):
        if device is None or torch.device(device).type == "cpu":
            return decode_with_pillow(data, mode=mode)
        gpu = self.gpu
        if self.private is None:
            self.private = cuda_model.Stream(gpu, "nvjpeg")
        for item in data:
            if bytes(item[:2].tolist()) != b"\xff\xd8":
                raise RuntimeError("Error while decoding JPEG images: Failed to get image info")
            self.read_in_slot.append(any(start <= item.data_ptr() < start + n
                                         for start, n in gpu.registered.items()))
        pixels = decode_with_pillow(data, mode=ImageReadMode.RGB)
        grey = [Image.open(io.BytesIO(np.asarray(d).tobytes())).mode == "L" for d in data]
        outputs = [torch.empty(p.shape, dtype=torch.uint8, device=device) for p in pixels]
        self.private.synchronize()
        for output, values in zip(outputs, pixels, strict=True):
            gpu.write(self.private, output, values)
        self.private.synchronize()
        if mode is ImageReadMode.UNCHANGED:  # channels sliced off on the current stream
            outputs = [o[0].unsqueeze(0).clone() if g else o for o, g in zip(outputs, grey,
                                                                             strict=True)]
        event = torch.cuda.Event()
        event.record(self.private)
        torch.cuda.current_stream().wait_event(event)
        return outputs


@pytest.fixture
def gpu(monkeypatch):
    return cuda_model.install(monkeypatch, cuda_model.Gpu())


@pytest.fixture
def decoder(gpu, monkeypatch):
    decoder = TorchvisionDecoder(gpu)
    torchvision = types.ModuleType("torchvision")
    torchvision.io = types.ModuleType("torchvision.io")
    torchvision.io.decode_jpeg = decoder
    torchvision.io.ImageReadMode = ImageReadMode
    monkeypatch.setitem(sys.modules, "torchvision", torchvision)
    monkeypatch.setitem(sys.modules, "torchvision.io", torchvision.io)
    return decoder


def save(path, image, fmt="JPEG", **options):
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, fmt, **options)


def noise(mode, seed, size=(40, 32)):
    channels = {"L": 1, "RGB": 3, "CMYK": 4}[mode]
    values = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], channels), np.uint8)
    return Image.fromarray(values.squeeze(-1) if channels == 1 else values, mode)


def cpu_reference(folder, samples):
    """Each sample as the backend should give it: the same crop decoded on the CPU; for a file
    the workers decode, ImageFolder's (the cpu backend's) image."""
    cpu = ImageFolder(folder.root, folder.size, train=False)
    images = []
    for index in samples:
        item = folder[index]
        if isinstance(item["data"], np.ndarray):
            crop = crop_resize(decode_with_pillow([item["data"]]), [item["box"]], folder.size)
            images.append(crop.round().clamp(0, 255).to(torch.uint8)[0])
        else:
            images.append(cpu[index][0])
    return torch.stack(images)


def loader_for(folder, batch_size):
    return FastLoader(folder, batch_size=batch_size, num_workers=2, device="cuda",
                      collate_fn=encoded_collate, gpu_transform=nvjpeg_transform(folder.size))


def check_batches(gpu, folder, got, batch_size):
    gpu.run(*(s for s in gpu.streams if s.name != "default"))  # the decode runs ahead
    images = [gpu.read(batch[0]) for batch in got]
    for start, batch in zip(range(0, len(folder), batch_size), images, strict=True):
        want = cpu_reference(folder, range(start, min(start + batch_size, len(folder))))
        assert torch.equal(batch, want), f"batch at {start}"


def test_greyscale_images_never_race_the_next_batch(tmp_path, gpu, decoder):
    # In UNCHANGED mode the decoder would clone each greyscale image on the current stream and
    # free the original there, unrecorded: the next batch's outputs take that block, and the
    # decoder's own stream writes it before the clone has read it.
    for i in range(8):
        save(tmp_path / "grey" / f"{i}.jpg", noise("L", i))
    folder = EncodedImageFolder(tmp_path, 24, train=False)
    got = list(loader_for(folder, 2))
    check_batches(gpu, folder, got, 2)


def test_files_nvjpeg_cannot_take_are_decoded_by_the_workers(tmp_path, gpu, decoder):
    # ImageNet has a PNG named .JPEG and CMYK JPEGs: nvJPEG would fail the whole batch.
    save(tmp_path / "a" / "0.JPEG", noise("RGB", 0))
    save(tmp_path / "a" / "1.JPEG", noise("RGB", 1), "PNG")
    save(tmp_path / "a" / "2.JPEG", noise("CMYK", 2))
    save(tmp_path / "a" / "3.JPEG", noise("L", 3))
    data = (tmp_path / "a" / "0.JPEG").read_bytes()
    (tmp_path / "a" / "4.JPEG").write_bytes(data[: len(data) // 2])  # truncated
    folder = EncodedImageFolder(tmp_path, 24, train=False)
    assert [gpu_decodable((tmp_path / "a" / f"{i}.JPEG").read_bytes()) for i in range(5)] == \
        [True, False, False, True, False]
    with pytest.raises(OSError, match=r"4\.JPEG"):  # a truncated file is refused, as on the CPU
        list(loader_for(folder, 5))
    (tmp_path / "a" / "4.JPEG").unlink()
    folder = EncodedImageFolder(tmp_path, 24, train=False)
    got = list(loader_for(folder, 4))
    check_batches(gpu, folder, got, 4)


def test_on_error_skip_drops_a_file_nothing_can_decode(tmp_path, gpu, decoder):
    for i in range(3):
        save(tmp_path / "a" / f"{i}.JPEG", noise("RGB", i))
    (tmp_path / "a" / "3.JPEG").write_bytes(b"not an image at all")
    folder = EncodedImageFolder(tmp_path, 16, train=False, on_error="skip")
    (images, _), = list(loader_for(folder, 4))
    assert tuple(images.shape) == (3, 3, 16, 16)


def test_the_decode_waits_on_the_host_only_off_the_training_thread(tmp_path, gpu, decoder):
    # torchvision synchronises its stream twice a batch: that must not stop the training
    # thread, which queues the model's work meanwhile. The encoded files are read where the
    # workers wrote them (in the ring's slot), not copied first.
    root = make_imagefolder(tmp_path, images=12, classes=2)
    folder = EncodedImageFolder(root, 24, train=False)
    loader = loader_for(folder, 4)
    list(loader)
    gpu.run()
    got = list(loader)
    assert gpu.syncs and gpu.syncs_in("MainThread") == []
    assert all(decoder.read_in_slot[-len(folder):])
    check_batches(gpu, folder, got, 4)


def test_decoding_a_batch_reads_no_device_value_back(tmp_path, gpu, decoder):
    # The only host waits are the decoder's own, on its private stream.
    root = make_imagefolder(tmp_path, images=6, classes=2)
    folder = EncodedImageFolder(root, 32, train=True)
    batch = encoded_collate([folder[i] for i in range(6)])
    batch["data"] = [np.array(d) for d in batch["data"]]  # writable, as views of a slot are
    on_device = map_tensors(lambda t: t.pin_memory().to("cuda", non_blocking=True), batch)
    images, targets = NvjpegDecode(32)(on_device)
    assert tuple(images.shape) == (6, 3, 32, 32) and images.dtype == torch.uint8
    assert {what for what, _ in gpu.syncs} == {"nvjpeg.synchronize()"}
    gpu.run()
    assert torch.equal(gpu.read(targets), batch["target"])


def test_batched_crop_resize_equals_each_crop_resized_alone(tmp_path):
    folder = EncodedImageFolder(make_imagefolder(tmp_path, images=6, classes=2), 32, train=True)
    batch = encoded_collate([folder[i] for i in range(6)])
    images = decode_with_pillow(batch["data"])
    got = crop_resize(images, batch["box"], 32)
    for image, (x, y, w, h), resized in zip(images, batch["box"], got, strict=True):
        crop = image[:, y:y + h, x:x + w].unsqueeze(0).float()
        want = torch.nn.functional.interpolate(crop, size=(32, 32), mode="bilinear",
                                               antialias=True, align_corners=False)[0]
        assert torch.equal(resized, want)


def test_the_decoder_pickles_without_its_stream(gpu, decoder):
    decode = NvjpegDecode(32)
    decode.decode([torch.frombuffer(bytearray(jpeg_bytes()), dtype=torch.uint8)],
                  torch.device("cuda", 0))
    assert decode._decode_stream is not None
    assert pickle.loads(pickle.dumps(decode))._decode_stream is None


def jpeg_bytes():
    file = io.BytesIO()
    noise("RGB", 0).save(file, "JPEG")
    return file.getvalue()


# -- on a GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_decode_matches_the_cpu_and_waits_for_nothing(tmp_path):
    pytest.importorskip("torchvision")
    folder = EncodedImageFolder(make_imagefolder(tmp_path, images=6, classes=2), 32, train=True)
    batch = encoded_collate([folder[i] for i in range(6)])
    on_gpu = map_tensors(lambda t: t.cuda(), batch)
    images, targets = NvjpegDecode(32)(on_gpu)  # the first call sets up nvJPEG
    assert images.is_cuda and targets.is_cuda
    # Against the same crops of the images decoded on the CPU (nvJPEG's IDCT may differ from
    # libjpeg's by a grey level).
    want = crop_resize(decode_with_pillow(batch["data"]), batch["box"], 32).round().clamp(0, 255)
    flip = batch["flip"].view(-1, 1, 1, 1)
    want = torch.where(flip, want.flip(-1), want)
    assert (images.cpu().float() - want).abs().mean() < 3.0
    from torchvision.io import decode_jpeg

    decoded = decode_jpeg([torch.from_numpy(d) for d in batch["data"]], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        crop_resize(decoded, batch["box"], 32)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_gpu_decode_of_greyscale_and_non_jpeg_files(tmp_path):
    # Greyscale JPEGs (decoded to RGB), a PNG named .JPEG and a CMYK JPEG (decoded by the
    # workers), over several batches with a busy consumer: each image as the CPU decodes it.
    # The colour JPEGs keep full-resolution chroma (4:4:4): libjpeg interpolates subsampled
    # chroma ("fancy upsampling") where nvJPEG replicates it, which on per-pixel noise differs
    # by 7 grey levels on average (measured on an H100): the reference would not be the CPU's.
    pytest.importorskip("torchvision")
    for i in range(12):
        path = tmp_path / "a" / f"{i}.JPEG"
        if i % 3:
            save(path, noise("L", i, (64, 48)))
        else:
            save(path, noise("RGB", i, (64, 48)), subsampling=0)
    save(tmp_path / "a" / "12.JPEG", noise("RGB", 12), "PNG")
    save(tmp_path / "a" / "13.JPEG", noise("CMYK", 13))
    folder = EncodedImageFolder(tmp_path, 32, train=False)
    loader = loader_for(folder, 4)
    big = torch.randn(2048, 2048, device="cuda")
    seen = []
    for images, _ in loader:
        big = big @ big / 2048  # keeps the consumer's stream busy while later batches decode
        seen.append(images.clone())
    torch.cuda.synchronize()
    got = torch.cat([s.cpu() for s in seen]).float()
    want = cpu_reference(folder, range(len(folder))).float()
    assert (got - want).abs().mean(dim=(1, 2, 3)).max() < 3.0
