"""The nvjpeg backend's batch logic on the CPU: no device value is read back, and the batched
crop-resize equals resizing each crop alone. (Decoding on a GPU: ``test_vision.py``, gpu.)"""

import io
import pickle
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from fastfeed.tree import map_tensors
from fastfeed.vision.nvjpeg import EncodedImageFolder, NvjpegDecode, crop_resize, encoded_collate
from fastfeed.vision.synthetic import make_imagefolder

HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy,
              torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__index__,
              torch.Tensor.__float__}


class OnDevice(torch.Tensor):
    """A tensor standing for device memory: reading its values on the host (what would make
    the host wait for the GPU) fails the test."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            raise AssertionError(f"the host reads a device value back: Tensor.{func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


def decode_with_pillow(data, device=None):
    """torchvision.io.decode_jpeg's contract (a list of C×H×W uint8), on the CPU."""
    return [torch.from_numpy(np.asarray(Image.open(io.BytesIO(np.asarray(d).tobytes())).convert(
        "RGB"))).permute(2, 0, 1).contiguous() for d in data]


@pytest.fixture
def batch(tmp_path, monkeypatch):
    torchvision = types.ModuleType("torchvision")
    torchvision.io = types.ModuleType("torchvision.io")
    torchvision.io.decode_jpeg = decode_with_pillow
    monkeypatch.setitem(sys.modules, "torchvision", torchvision)
    monkeypatch.setitem(sys.modules, "torchvision.io", torchvision.io)
    folder = EncodedImageFolder(make_imagefolder(tmp_path, images=6, classes=2), 32, train=True)
    return encoded_collate([folder[i] for i in range(6)])


def test_decoding_a_batch_never_reads_device_values_back(batch):
    # What device prefetch hands NvjpegDecode: every tensor of the batch on the device.
    on_device = map_tensors(lambda t: t.as_subclass(OnDevice), batch)
    images, targets = NvjpegDecode(32)(on_device)
    assert images.shape == (6, 3, 32, 32) and images.dtype == torch.uint8
    assert torch.equal(targets, batch["target"])


def test_batched_crop_resize_equals_each_crop_resized_alone(batch):
    images = decode_with_pillow(batch["data"])
    images[1] = images[1][:1]  # a greyscale JPEG decodes to one channel
    got = crop_resize(images, batch["box"], 32)
    for image, (x, y, w, h), resized in zip(images, batch["box"], got, strict=True):
        crop = image[:, y:y + h, x:x + w].unsqueeze(0).float().expand(-1, 3, -1, -1)
        want = torch.nn.functional.interpolate(crop, size=(32, 32), mode="bilinear",
                                               antialias=True, align_corners=False)[0]
        assert torch.equal(resized, want)


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


class FakeStream:
    """Records the stream operations NvjpegDecode makes, in order, into a shared log."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")


def test_decoder_outputs_never_race_the_copy_stream(monkeypatch, batch):
    """Issue 23, finding 5. torchvision allocates decode_jpeg's outputs on the current stream
    and writes them on a private stream that waits for nothing: run on the copy stream, it
    could write a block the copy stream's queued kernels still read. The decode must run under
    a stream of its own that first waits for the copy stream, and the copy stream must wait
    for it and record its use of every output."""
    log = []
    copy_stream = FakeStream("copy", log)
    current = [copy_stream]
    made = []

    def new_stream(device):
        made.append(FakeStream("decode", log))
        return made[-1]

    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            current.append(self.stream)

        def __exit__(self, *exc):
            current.pop()

    class Output(torch.Tensor):
        def record_stream(self, stream):
            log.append(f"output used on {stream.name}")

    def decode_jpeg(data, device=None):
        log.append(f"decode_jpeg under {current[-1].name}")
        return [image.as_subclass(Output) for image in decode_with_pillow(data)]

    monkeypatch.setattr(sys.modules["torchvision"].io, "decode_jpeg", decode_jpeg)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    decoder = NvjpegDecode(32)
    encoded = [torch.from_numpy(np.array(d)) for d in batch["data"]]
    for _ in range(2):
        decoder.decode(encoded, torch.device("cuda", 0))
    per_batch = ["decode waits for copy", "decode_jpeg under decode", "copy waits for decode",
                 *["output used on copy"] * len(encoded)]
    assert log == per_batch * 2
    assert len(made) == 1  # one stream per decoder, not one per batch
    assert pickle.loads(pickle.dumps(decoder))._decode_stream is None
