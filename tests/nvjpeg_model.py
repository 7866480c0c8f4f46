"""``torchvision.io.decode_jpeg(device="cuda")`` on the modelled device (``cuda_model``), as
torchvision's ``decode_jpegs_cuda.cpp`` runs it: outputs allocated on the current stream,
written on a private stream the host synchronises (twice a batch), and in ``UNCHANGED`` mode a
greyscale image cloned on the current stream. The pixels are Pillow's (the decode stand-in):
what nvJPEG does differently (no fancy chroma upsampling, its IDCT) is measured on a GPU."""

from __future__ import annotations

import enum
import io
import sys
import types

import cuda_model
import numpy as np
import torch
from PIL import Image

from fastfeed.vision import gpu_decode


class ImageReadMode(enum.Enum):
    UNCHANGED, GRAY, RGB = 0, 1, 3


def decode_with_pillow(data, device=None, mode=ImageReadMode.RGB):
    """torchvision.io.decode_jpeg's contract on the CPU: a list of C×H×W uint8."""
    images = []
    for item in data:
        image = Image.open(io.BytesIO(np.asarray(item).tobytes()))
        if mode.name == "RGB" or image.mode != "L":
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
        self.refused = set()  # the files (bytes) nvJPEG refuses, as it refuses a corrupt one
        self.read_in_slot = []  # per encoded file: read where the worker left it
        self.streams = []  # per call: the caller's current stream (the outputs' allocator's)
        self.calls = 0

    def __call__(self, data, device=None, mode=ImageReadMode.UNCHANGED):
        if device is None or torch.device(device).type == "cpu":
            return decode_with_pillow(data, mode=mode)
        self.calls += 1
        gpu = self.gpu
        self.streams.append(torch.cuda.current_stream())
        if self.private is None:
            self.private = cuda_model.Stream(gpu, "nvjpeg")
        for item in data:
            if bytes(item[:2].tolist()) != b"\xff\xd8":
                raise RuntimeError("Error while decoding JPEG images: Failed to get image info")
            self.read_in_slot.append(any(start <= item.data_ptr() < start + n
                                         for start, n in gpu.registered.items()))
        try:  # one file it cannot decode fails the call
            if any(item.numpy().tobytes() in self.refused for item in data):
                raise ValueError("refused")
            pixels = decode_with_pillow(data, mode=ImageReadMode.RGB)
        except Exception as error:
            raise RuntimeError(f"Error while decoding JPEG images: {error}") from None
        grey = [Image.open(io.BytesIO(np.asarray(d).tobytes())).mode == "L" for d in data]
        outputs = [torch.empty(p.shape, dtype=torch.uint8, device=device) for p in pixels]
        self.private.synchronize()
        for output, values in zip(outputs, pixels, strict=True):
            gpu.write(self.private, output, values)
        self.private.synchronize()
        if mode.name == "UNCHANGED":  # channels sliced off on the current stream
            outputs = [o[0].unsqueeze(0).clone() if g else o for o, g in zip(outputs, grey,
                                                                             strict=True)]
        event = torch.cuda.Event()
        event.record(self.private)
        torch.cuda.current_stream().wait_event(event)
        return outputs


def install(monkeypatch, gpu) -> TorchvisionDecoder:
    """Make ``torchvision.io.decode_jpeg`` the modelled decoder (a stand-in torchvision module
    where torchvision is not installed)."""
    decoder = TorchvisionDecoder(gpu)
    monkeypatch.setattr(gpu_decode, "_decode_streams", {})  # a new process's
    try:
        import torchvision.io
    except Exception:  # missing, or built for another torch
        torchvision = types.ModuleType("torchvision")
        torchvision.io = types.ModuleType("torchvision.io")
        torchvision.io.ImageReadMode = ImageReadMode
        monkeypatch.setitem(sys.modules, "torchvision", torchvision)
        monkeypatch.setitem(sys.modules, "torchvision.io", torchvision.io)
    monkeypatch.setattr(sys.modules["torchvision.io"], "decode_jpeg", decoder, raising=False)
    return decoder
