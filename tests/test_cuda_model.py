"""The CPU model of CUDA (``cuda_model``) stays in the process that installed it: a worker
forked meanwhile gets torch's own ``torch.cuda`` back, as on a machine with a real GPU, where
the model's answers would break it."""

import contextlib
import multiprocessing

import cuda_model
import pytest
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


# -- the model's rules: each can show what breaks it -------------------------------------------

def test_leaving_a_stream_block_on_a_new_thread_makes_a_context_on_device_0(monkeypatch):
    import threading

    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(devices=2))
    torch.cuda.set_device(1)
    stream = torch.cuda.Stream()  # of device 1

    def helper(guarded):
        guard = torch.cuda.device(1) if guarded else contextlib.nullcontext()
        with guard, torch.cuda.stream(stream):
            torch.zeros(4, device="cuda")
        seen.append(torch.cuda.current_device())

    seen = []
    for guarded in (True, False):
        thread = threading.Thread(target=helper, args=(guarded,))
        thread.start()
        thread.join()
        assert gpu.contexts == ({1} if guarded else {0, 1})
    assert seen == [0, 0] and torch.cuda.current_device() == 1


def test_the_allocator_rounds_carves_caches_per_stream_and_flushes(monkeypatch):
    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(64 << 20))
    allocator = gpu.allocators[0]
    side = torch.cuda.Stream()
    small = torch.empty(1000, dtype=torch.uint8, device="cuda")
    assert gpu.block_of(small).nbytes == 1024 and allocator.reserved == 2 << 20
    large = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    assert allocator.reserved == (2 + 20) << 20  # a 20 MiB segment for a 3 MiB request
    address = large.data_ptr()
    del large
    again = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")  # the same stream: at once
    assert again.data_ptr() == address
    with torch.cuda.stream(side):  # another stream: not from the default stream's cache
        other = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")
    assert other.data_ptr() != address and allocator.reserved == (2 + 20 + 20) << 20
    again.record_stream(side)
    del again
    reused = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")
    assert reused.data_ptr() != address  # side has not passed the point it was at
    del reused, other
    huge = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")  # the flush frees the cache
    assert allocator.flushes == 1 and gpu.syncs  # waiting for side's use
    with pytest.raises(torch.OutOfMemoryError, match=r"CUDA out of memory\. Tried to allocate "
                                                      r"40\.00 MiB\. GPU 0 has a total capacity"):
        torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
    assert allocator.memory.driver_malloc(30 << 20) is None  # a library shares what is left
    del huge, small


def test_torchs_stream_pool_is_per_device_and_round_robin(monkeypatch):
    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(devices=2))
    first = torch.cuda.Stream()
    for _ in range(cuda_model.POOL_SIZE - 1):
        torch.cuda.Stream()
    assert torch.cuda.Stream() is first and first.device_index == 0
    with torch.cuda.device(1):
        assert torch.cuda.Stream().device_index == 1
    assert torch.cuda.Stream(priority=-1) is not first
    assert gpu.current_stream(1) is gpu.default_stream(1)


def test_set_device_makes_the_context_even_of_the_current_device_a_guard_does_not(monkeypatch):
    import threading

    gpu = cuda_model.install(monkeypatch, cuda_model.Gpu(devices=2))
    torch.zeros(4, device="cuda:1")
    with torch.cuda.device(0):  # current already: no cudaSetDevice
        pass
    assert gpu.contexts == {1}
    helper = threading.Thread(target=torch.cuda.set_device, args=(0,))
    helper.start()
    helper.join()
    assert gpu.contexts == {0, 1}
