"""The nvjpeg backend on the modelled device (``cuda_model``), its decoder modelled on what
torchvision's CUDA code does (``nvjpeg_model``). Each batch the device ends with is compared
with the same crops decoded and resized on the CPU, by the same batched resize. (On a GPU: the
``gpu`` tests below.)"""

import io
import pickle
import struct

import cuda_model
import numpy as np
import nvjpeg_model
import pytest
import torch
from helpers import host_syncs_raise
from nvjpeg_model import decode_with_pillow
from PIL import Image

from fastfeed import FastLoader
from fastfeed import transforms as T
from fastfeed.device.own_streams import own_stream
from fastfeed.tree import map_tensors
from fastfeed.vision import DecodeError, ImageFolder, image_loader
from fastfeed.vision.encoded_folder import EncodedImageFolder, nvjpeg_transform
from fastfeed.vision.gpu_decode import (
    DecodeCrops,
    collate_crops,
    encoded_collate,
    gpu_decodable,
)
from fastfeed.vision.synthetic import make_imagefolder


@pytest.fixture
def gpu(monkeypatch):
    return cuda_model.install(monkeypatch, cuda_model.Gpu())


@pytest.fixture
def decoder(gpu, monkeypatch):
    return nvjpeg_model.install(monkeypatch, gpu)


def save(path, image, fmt="JPEG", **options):
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, fmt, **options)


def noise(mode, seed, size=(40, 32)):
    channels = {"L": 1, "RGB": 3, "CMYK": 4}[mode]
    values = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], channels), np.uint8)
    return Image.fromarray(values.squeeze(-1) if channels == 1 else values, mode)


def cpu_reference(folder, samples):
    """The samples as the backend should give them: the same crops, the files decoded by
    Pillow, the batch resized on the CPU (the files the workers decode: ImageFolder's image,
    the cpu backend's)."""
    crops = [folder[index][0] for index in samples]
    return DecodeCrops(decoder=decode_with_pillow).images(collate_crops(crops))


def loader_for(folder, batch_size):
    return FastLoader(folder, batch_size=batch_size, num_workers=2, device="cuda",
                      collate_fn=encoded_collate, gpu_transform=nvjpeg_transform())


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
    # The workers' crops are the cpu backend's, bit for bit (the batched resize keeps them).
    cpu = ImageFolder(tmp_path, 24, train=False)
    assert torch.equal(gpu.read(got[0][0])[1:3], torch.stack([cpu[1][0], cpu[2][0]]))


def test_on_error_skip_drops_a_file_nothing_can_decode(tmp_path, gpu, decoder):
    for i in range(3):
        save(tmp_path / "a" / f"{i}.JPEG", noise("RGB", i))
    (tmp_path / "a" / "3.JPEG").write_bytes(b"not an image at all")
    folder = EncodedImageFolder(tmp_path, 16, train=False, on_error="skip")
    (images, _), = list(loader_for(folder, 4))
    assert tuple(images.shape) == (3, 3, 16, 16)


def segments(data):
    """A JPEG's marker segments before its first scan, ``[(marker, bytes)]``, and the rest."""
    at, found = 2, []
    while data[at + 1] != 0xDA:
        end = at + 2 + int.from_bytes(data[at + 2:at + 4], "big")
        found.append((data[at + 1], data[at:end]))
        at = end
    return found, data[at:]


def rebuilt(data, drop=(), add=b""):
    """``data`` without the segments of the markers in ``drop``, with ``add`` first."""
    found, rest = segments(data)
    return b"\xff\xd8" + add + b"".join(s for m, s in found if m not in drop) + rest


def with_sampling(data, luma):
    """``data`` with its frame header's luma sampling factors byte set to ``luma``."""
    at = data.index(b"\xff\xc0")
    return data[:at + 11] + bytes([luma]) + data[at + 12:]


def test_unusual_jpegs_are_left_to_the_workers():
    # nvJPEG's sampling: 4:4:4, 4:2:2, 4:2:0, 4:4:0 and greyscale (torchvision refuses what
    # nvJPEG calls unknown, for the whole batch); libjpeg's RGB JPEGs (no JFIF marker, and an
    # Adobe marker with transform 0, or none and the component ids R, G, B): the CPU's.
    rgb = jpeg_bytes()  # Pillow's: JFIF, 4:2:0, component ids 1, 2, 3
    assert gpu_decodable(rgb) and gpu_decodable(with_sampling(rgb, 0x12))  # 4:4:0
    assert not gpu_decodable(with_sampling(rgb, 0x41))  # 4:1:1
    assert not gpu_decodable(with_sampling(rgb, 0x13))
    adobe = b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00"
    assert not gpu_decodable(rebuilt(rgb, drop=[0xE0], add=adobe + b"\x00"))
    assert gpu_decodable(rebuilt(rgb, drop=[0xE0], add=adobe + b"\x01"))  # YCbCr
    frame = rgb.index(b"\xff\xc0")
    ids = bytearray(rgb)
    ids[frame + 10:frame + 19:3] = b"RGB"
    assert gpu_decodable(bytes(ids))  # JFIF says YCbCr
    assert not gpu_decodable(rebuilt(bytes(ids), drop=[0xE0]))
    assert gpu_decodable(rebuilt(rgb, drop=[0xE0]))


def test_a_jpeg_its_exif_orientation_turns_is_left_to_the_workers():
    # TorchCodec's GPU decode applies the orientation; Pillow (torchvision's ImageFolder, the
    # CPU route) does not: the image and the window drawn from its header would turn.
    for order in "<>":  # little- and big-endian TIFF
        for orientation, decodable in ((1, True), (6, False), (3, False)):
            entries = [(0x010F, 2, 4, b"cam\0"),  # another tag first
                       (0x0112, 3, 1, struct.pack(order + "HH", orientation, 0))]
            tiff = ((b"II" if order == "<" else b"MM") + struct.pack(order + "HI", 42, 8)
                    + struct.pack(order + "H", len(entries))
                    + b"".join(struct.pack(order + "HHI", *entry[:3]) + entry[3]
                               for entry in entries) + struct.pack(order + "I", 0))
            file = io.BytesIO()
            noise("RGB", 0).save(file, "JPEG", exif=b"Exif\0\0" + tiff)
            assert gpu_decodable(file.getvalue()) == decodable, (order, orientation)


def test_a_file_nvjpeg_refuses_is_decoded_on_the_host(tmp_path, gpu, decoder, caplog):
    # torchvision fails the whole call for one file nvJPEG refuses: the batch is decoded file by
    # file, and the refused file on the host, in its place.
    for i in range(6):
        save(tmp_path / "a" / f"{i}.JPEG", noise("RGB", i))
    decoder.refused.add((tmp_path / "a" / "1.JPEG").read_bytes())
    folder = EncodedImageFolder(tmp_path, 24, train=False)
    got = list(loader_for(folder, 3))
    check_batches(gpu, folder, got, 3)
    assert decoder.calls == 1 + 3 + 1
    assert "1.JPEG" in caplog.text and "decoded on the host" in caplog.text


def test_a_file_nothing_decodes_fails_its_batch_naming_it(tmp_path, gpu, decoder):
    # Its header passes the workers' checks (on_error has nothing to skip); neither nvJPEG nor
    # the CPU decodes it (no quantisation table): the error names it, even with skip.
    for i in range(4):
        save(tmp_path / "a" / f"{i}.JPEG", noise("RGB", i))
    victim = tmp_path / "a" / "2.JPEG"
    victim.write_bytes(rebuilt(victim.read_bytes(), drop=[0xDB]))
    assert gpu_decodable(victim.read_bytes())
    folder = EncodedImageFolder(tmp_path, 24, train=False, on_error="skip")
    with pytest.raises(DecodeError, match=r"2\.JPEG.*on_error does not apply"):
        list(loader_for(folder, 4))


def test_the_decode_waits_on_the_host_only_off_the_training_thread(tmp_path, gpu, decoder):
    # torchvision synchronises its stream twice a batch: that must not stop the training
    # thread, which queues the model's work meanwhile. The encoded files are read where the
    # workers wrote them (in the slot pool's slot), not copied first.
    root = make_imagefolder(tmp_path, images=12, classes=2)
    folder = EncodedImageFolder(root, 24, train=False)
    loader = loader_for(folder, 4)
    list(loader)
    gpu.run()
    got = list(loader)
    assert gpu.syncs and gpu.syncs_in("MainThread") == []
    assert all(decoder.read_in_slot[-len(folder):])
    check_batches(gpu, folder, got, 4)


def to_device(tensor):
    """What FastLoader's copy does (the model counts any copy of an empty tensor as a sync)."""
    if not tensor.numel():
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cuda")
    return tensor.pin_memory().to("cuda", non_blocking=True)


def test_decoding_a_batch_reads_no_device_value_back(tmp_path, gpu, decoder):
    # The only host waits are the decoder's own, on its stream (one of torch's pool).
    root = make_imagefolder(tmp_path, images=6, classes=2)
    folder = EncodedImageFolder(root, 32, train=True)
    batch = encoded_collate([folder[i] for i in range(6)])
    on_device = map_tensors(to_device, batch)
    images, targets = DecodeCrops()(on_device)
    assert tuple(images.shape) == (6, 3, 32, 32) and images.dtype == torch.uint8
    assert {what for what, _ in gpu.syncs} == {f"{decoder.stream.name}.synchronize()"}
    assert decoder.calls == 1, "one decode call a batch"
    gpu.run()
    assert torch.equal(gpu.read(targets), batch[1])


def test_image_loader_builds_the_backend_and_its_gpu_transform_runs_after(tmp_path, gpu,
                                                                           decoder):
    # With the user's gpu_transform after the decode, the decode still waits on the host
    # only in the helper thread.
    root = make_imagefolder(tmp_path, images=10, classes=2)
    folder = EncodedImageFolder(root, 24, train=False)
    loader = image_loader(root, batch_size=4, size=24, train=False, backend="nvjpeg",
                          device="cuda", num_workers=2, gpu_transform=T.Normalize(key=0))
    list(loader)
    gpu.run()
    syncs = len(gpu.syncs_in("MainThread"))
    got = list(loader)
    assert gpu.syncs_in("MainThread")[syncs:] == []
    gpu.run()
    for start, (images, targets) in zip(range(0, 10, 4), got, strict=True):
        want = T.Normalize(key=0)([cpu_reference(folder, range(start, min(start + 4, 10)))])
        assert torch.equal(gpu.read(images), want[0])
        assert gpu.read(targets).tolist() == [folder.targets[i] for i in range(start,
                                                                               start + 4)
                                              if i < 10]


def test_flips_and_boxes_are_the_workers_draws(tmp_path):
    # The crop box and the flip each worker draws reach the GPU: the batch equals the same
    # crops made one at a time (torch's interpolate), mirrored where the worker flipped.
    folder = EncodedImageFolder(make_imagefolder(tmp_path, images=8, classes=2), 32, train=True)
    torch.manual_seed(0)
    samples = [folder[i][0] for i in range(8)]
    images = DecodeCrops(decoder=decode_with_pillow).images(collate_crops(samples))
    flips = 0
    for crop, got in zip(samples, images, strict=True):
        x, y, w, h = (int(v) for v in crop.geometry[:4])
        image = decode_with_pillow([crop.data])[0][:, y:y + h, x:x + w]
        want = torch.nn.functional.interpolate(image[None].float(), size=(32, 32),
                                               mode="bilinear", antialias=True)[0]
        want = want.flip(-1) if crop.geometry[10] else want
        flips += int(crop.geometry[10])
        assert (got.float() - want).abs().max() <= 0.5 + 1e-3
    assert 0 < flips < 8


def test_the_decode_stream_is_never_one_of_torchs_pool(tmp_path, gpu, decoder):
    # torch.cuda.Stream() hands out torch's 32 pool streams round-robin. Here the user (or
    # FSDP, NCCL) took the other 31 after the loader's copy stream: a decode stream from the
    # pool would be the copy stream, and the decoder's outputs would take the blocks the last
    # batch's resize freed there while its kernels, still queued, read them.
    folder = EncodedImageFolder(make_imagefolder(tmp_path, images=8, classes=2), 24,
                                train=False)
    batches = [encoded_collate([folder[i] for i in range(start, start + 4)])
               for start in (0, 4)]
    copy = torch.cuda.Stream()
    taken = [torch.cuda.Stream() for _ in range(cuda_model.POOL_SIZE - 1)]
    decode, got = DecodeCrops(), []
    with torch.cuda.stream(copy):
        for batch in batches:
            got.append(decode(map_tensors(to_device, batch))[0])
    gpu.run()
    for start, images in zip((0, 4), got, strict=True):
        assert torch.equal(gpu.read(images), cpu_reference(folder, range(start, start + 4)))
    assert copy not in decoder.streams and not set(taken) & set(decoder.streams)


def test_one_decode_stream_per_process_whatever_the_epochs(tmp_path, gpu, decoder):
    # accelerate's route makes a new DecodeCrops each epoch (and there may be several
    # loaders): they share one stream, made once (no CUDA stream per epoch), and a new
    # decoder pickles without it.
    folder = EncodedImageFolder(make_imagefolder(tmp_path, images=4, classes=2), 16,
                                train=False)
    batch = encoded_collate([folder[i] for i in range(4)])
    for _ in range(3):
        decode = pickle.loads(pickle.dumps(DecodeCrops()))
        decode(map_tensors(to_device, batch))
    assert len(gpu.driver.created) == 1
    assert decoder.streams == 3 * [stream for stream, _ in gpu.driver.created]


def jpeg_bytes():
    file = io.BytesIO()
    noise("RGB", 0).save(file, "JPEG")
    return file.getvalue()


# -- on a GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
def test_on_a_gpu_the_decode_stream_is_none_of_torchs():
    stream = own_stream(torch.device("cuda", 0), "decode")
    assert own_stream(torch.device("cuda"), "decode") is stream
    torchs = {torch.cuda.Stream().cuda_stream for _ in range(64)}
    torchs |= {torch.cuda.Stream(priority=-1).cuda_stream for _ in range(64)}
    assert stream.cuda_stream not in torchs | {torch.cuda.default_stream().cuda_stream}
    with torch.cuda.stream(stream):  # a working stream of the device
        ones = torch.ones(4, device="cuda")
    stream.synchronize()
    assert ones.sum().item() == 4


@pytest.mark.gpu
def test_gpu_decode_matches_the_cpu_and_waits_for_nothing(tmp_path):
    pytest.importorskip("torchvision")
    folder = EncodedImageFolder(make_imagefolder(tmp_path, images=6, classes=2), 32, train=True)
    batch = encoded_collate([folder[i] for i in range(6)])
    on_gpu = map_tensors(lambda t: t.cuda(), batch)
    images, targets = DecodeCrops()(on_gpu)  # the first call sets up nvJPEG
    assert images.is_cuda and targets.is_cuda
    # Against the same crops of the images decoded on the CPU (nvJPEG's IDCT and chroma
    # upsampling differ from libjpeg's by a few grey levels).
    want = DecodeCrops(decoder=decode_with_pillow).images(batch[0]).float()
    assert (images.cpu().float() - want).abs().mean() < 3.0
    from torchvision.io import decode_jpeg

    decoded = decode_jpeg([torch.from_numpy(d) for d in batch[0]["encoded"]], device="cuda")
    from fastfeed.vision.resample import resize_crops

    with host_syncs_raise():
        resize_crops(decoded, batch[0]["geometry"])


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
