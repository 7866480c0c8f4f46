"""The CPU model of CUDA (``cuda_model``) stays in the process that installed it: a worker
forked meanwhile gets torch's own ``torch.cuda`` back, as on a machine with a real GPU, where
the model's answers would break it."""

import multiprocessing

import cuda_model
import torch
from sample_datasets import TensorDataset

from fastfeed import FastLoader
from fastfeed.slots import page_lock

CUDA_NAMES = ("is_available", "device_count", "current_device", "is_initialized", "Stream",
              "Event", "stream", "current_stream", "default_stream", "synchronize")
TENSOR_NAMES = ("to", "cuda", "is_pinned", "pin_memory", "record_stream")
FACTORY_NAMES = ("empty", "zeros", "full", "arange", "tensor", "as_tensor")


def current():
    """What the names the model replaces hold, here and now."""
    return {**{f"torch.cuda.{n}": getattr(torch.cuda, n) for n in CUDA_NAMES},
            **{f"torch.Tensor.{n}": getattr(torch.Tensor, n) for n in TENSOR_NAMES},
            **{f"torch.{n}": getattr(torch, n) for n in FACTORY_NAMES},
            "TorchCudaRuntime": page_lock.TorchCudaRuntime}


def replaced_in(real):
    """The names whose object differs from ``real``'s, here."""
    return sorted(name for name, value in current().items() if value is not real[name])


def report(real, connection):
    connection.send(replaced_in(real))


def test_a_child_forked_under_the_model_gets_torchs_own_cuda(monkeypatch):
    real = current()
    cuda_model.install(monkeypatch, cuda_model.Gpu())
    assert len(replaced_in(real)) == len(real)  # the model is installed here
    fork = multiprocessing.get_context("fork")
    ours, theirs = fork.Pipe()
    child = fork.Process(target=report, args=(real, theirs))
    child.start()
    in_child = ours.recv()
    child.join()
    assert in_child == []
    assert len(replaced_in(real)) == len(real)  # and still here


def test_workers_seed_torch_as_on_a_machine_with_cuda(monkeypatch):
    # A worker's torch.manual_seed seeds every CUDA device when torch.cuda.is_initialized():
    # under the model's answer it would index the child's (empty) device generators.
    cuda_model.install(monkeypatch, cuda_model.Gpu())
    monkeypatch.setattr(torch.cuda.random, "device_count", lambda: 1)  # a machine with a GPU
    dataset = TensorDataset(n=16, shape=(3,))
    loader = FastLoader(dataset, batch_size=4, num_workers=2, device="cuda")
    assert len(list(loader)) == 4
