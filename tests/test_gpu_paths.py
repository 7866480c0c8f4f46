"""The GPU paths as a user with several GPUs meets them, on the modelled machine
(``cuda_model``): the devices a rank touches, device memory, the decoders' errors and streams,
the first batch's Triton compile and the doctor's GPU clock."""

import io

import cuda_model
import numpy as np
import nvjpeg_model
import pytest
import torch
from helpers import assert_same
from PIL import Image
from sample_datasets import TensorDataset
from torch.utils.data import DataLoader

from fastfeed import FastLoader
from fastfeed.device.own_streams import OwnStreamError
from fastfeed.tree import map_tensors
from fastfeed.vision.gpu_decode import DecodeCrops, EncodedCrop, collate_crops
from fastfeed.vision.resample import crop_geometry


class OnTheHelper:
    """A gpu_transform that runs on the device stage's helper thread (``blocks_host``), as the
    GPU decode and the Ultralytics pixel ops do, and computes on the batch."""

    blocks_host = True

    def __call__(self, batch):
        return [batch[0] + 1, batch[1]]


@pytest.mark.parametrize("rank", ["set_device", "device index"])
def test_a_rank_makes_no_context_on_a_gpu_it_does_not_use(monkeypatch, rank):
    # Rank 1 of a DDP job: its script calls torch.cuda.set_device(1), or names cuda:1 and
    # never sets the device. Leaving torch.cuda.stream(copy stream) on the helper thread (on
    # device 0, as every new thread) restored device 0's stream through cudaSetDevice(0):
    # a context (half a GiB) on GPU 0 from every rank.
    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(devices=2))
    if rank == "set_device":
        torch.cuda.set_device(1)
    dataset = TensorDataset(n=16, shape=(3, 4, 4))
    loader = FastLoader(dataset, batch_size=4, num_workers=2, gpu_transform=OnTheHelper(),
                        device="cuda" if rank == "set_device" else "cuda:1")
    got = list(loader)
    gpu.run()
    assert gpu.contexts == {1}
    assert {batch[0].device for batch in got} == {torch.device("cuda", 1)}
    assert_same([[b[0] + 1, b[1]] for b in DataLoader(dataset, batch_size=4)],
                [map_tensors(gpu.read, batch) for batch in got])
