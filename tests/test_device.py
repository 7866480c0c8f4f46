"""Device prefetch: the CPU path everywhere, the CUDA path where a GPU is present."""

import dataclasses
import gc

import pytest
import torch
from helpers import assert_same, compare, outcomes
from sample_datasets import (
    DetectionDataset,
    FailingDataset,
    MixedDataset,
    TensorDataset,
    detection_collate,
)
from torch.utils.data import DataLoader

from fastfeed import FastLoader
from fastfeed import transforms as T
from fastfeed.device import resolve_device


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("dataset", [MixedDataset, TensorDataset])
def test_cpu_device_gives_the_same_batches(num_workers, dataset):
    compare(dataset, batch_size=4, num_workers=num_workers, shuffle=True, generator=4,
            fast={"device": "cpu", "prefetch_depth": 3}, epochs=2)


class FailsOnBatch:
    """A gpu_transform that raises on the batch holding ``bad``."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __call__(self, batch):
        if (batch == self.bad).any():
            raise ValueError(f"transform refused the batch with {self.bad}")
        return batch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_error_comes_in_its_batch_turn_with_a_device(num_workers):
    """A dataset's error, and a gpu_transform's, is raised in its batch's turn, after the
    batches before it, and iteration goes on, as the stock loader's (no batch lost: the copy
    stage reads ahead of the consumer)."""
    kwargs = {"batch_size": 2, "num_workers": num_workers}
    expected = outcomes(DataLoader(FailingDataset(bad=5), **kwargs))
    assert [kind for kind, *_ in expected] == ["batch", "batch", "error", "batch", "batch", "batch"]
    got = outcomes(FastLoader(FailingDataset(bad=5), device="cpu", prefetch_depth=3, **kwargs))
    assert got == expected
    refused = outcomes(FastLoader(FailingDataset(bad=-1), device="cpu", prefetch_depth=3,
                                  gpu_transform=FailsOnBatch(6), **kwargs))
    assert refused == [("batch", [0, 1]), ("batch", [2, 3]), ("batch", [4, 5]),
                       ("error", "ValueError", "transform refused the batch with 6"),
                       ("batch", [8, 9]), ("batch", [10, 11])]


def test_gpu_transform_on_cpu_matches_reference():
    normalize = T.Normalize(key=0, dtype=torch.float16)
    expected = [normalize(b) for b in DataLoader(TensorDataset(), batch_size=4, num_workers=2)]
    got = list(FastLoader(TensorDataset(), batch_size=4, num_workers=2, device="cpu",
                          gpu_transform=normalize))
    assert_same(expected, got)


def test_detection_batches_with_flip_end_to_end():
    def pipeline():
        return T.Compose([
            T.RandomHorizontalFlip(key="img", boxes_key="bboxes", batch_idx_key="batch_idx"),
            T.Normalize(key="img"),
        ])

    loader = FastLoader(DetectionDataset(), batch_size=4, num_workers=2,
                        collate_fn=detection_collate, device="cpu", gpu_transform=pipeline(),
                        generator=torch.Generator().manual_seed(0))
    got = list(loader)
    # Reference: the same transform, seeded from the same base seed, on torch's batches.
    reference = pipeline()
    reference.seed(int(torch.empty((), dtype=torch.int64).random_(
        generator=torch.Generator().manual_seed(0)).item()))
    expected = [reference(b) for b in DataLoader(DetectionDataset(), batch_size=4, num_workers=2,
                                                 collate_fn=detection_collate)]
    assert_same(expected, got)
    assert got[0]["img"].dtype == torch.float32 and got[0]["im_files"][0] == "0.jpg"


def test_a_seeded_gpu_transform_draws_from_each_epochs_base_seed():
    # Side by side: the stock loader's batches, erased by a transform seeded as the loader
    # seeds it, from the base seed each epoch's iterator draws from the generator.
    loader = FastLoader(TensorDataset(), batch_size=4, num_workers=2, device="cpu",
                        gpu_transform=T.RandomErasing(p=1.0, key=0),
                        generator=torch.Generator().manual_seed(11))
    stock = DataLoader(TensorDataset(), batch_size=4, num_workers=2,
                       generator=torch.Generator().manual_seed(11))
    seeds = torch.Generator().manual_seed(11)
    for _ in range(2):
        erase = T.RandomErasing(p=1.0, key=0)
        erase.seed(int(torch.empty((), dtype=torch.int64).random_(generator=seeds).item()))
        expected = [erase(batch) for batch in stock]
        assert_same(expected, list(loader))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"device": "nonsense"}, ValueError, "not a valid torch device"),
    ({"device": "meta"}, ValueError, "'cpu' or 'cuda'"),
    ({"gpu_transform": T.Normalize()}, ValueError, "gpu_transform runs on the device"),
    ({"device": "cpu", "gpu_transform": 3}, TypeError, "callable"),
    ({"device": "cpu", "prefetch_depth": 0}, ValueError, "prefetch_depth"),
])
def test_bad_device_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        FastLoader(TensorDataset(), **kwargs)


def test_cuda_requested_without_cuda_is_an_error():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour")
    with pytest.raises(ValueError, match="CUDA is not available"):
        FastLoader(TensorDataset(), device="cuda")


def test_bare_cuda_means_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_bare_cuda_is_the_only_visible_gpu_whatever_the_local_rank(monkeypatch):
    # A launcher that gives each rank one GPU through CUDA_VISIBLE_DEVICES: it is cuda:0.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("cuda") == torch.device("cuda", 0)


def test_the_gpu_is_chosen_at_the_first_iteration_not_at_construction(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    loader = FastLoader(TensorDataset(), device="cuda")
    assert loader.device == torch.device("cuda") and loader._device_stage._target is None


def test_no_slot_leaks_across_epochs_on_the_device_path():
    loader = FastLoader(TensorDataset(n=64), batch_size=4, num_workers=2, device="cpu",
                        persistent_workers=True)
    for _ in range(4):
        for _batch in loader:
            pass
    del _batch
    gc.collect()
    slot_pool = loader._planner.slot_pool
    used, allocated = slot_pool.occupancy
    assert used == 0 and allocated <= slot_pool.max_slots


# -- on a GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
def test_batches_arrive_on_the_device():
    loader = FastLoader(DetectionDataset(), batch_size=4, num_workers=2, device="cuda",
                        collate_fn=detection_collate, gpu_transform=T.Normalize(key="img"))
    for batch in loader:
        assert batch["img"].is_cuda and batch["bboxes"].is_cuda and batch["batch_idx"].is_cuda
        assert batch["img"].dtype == torch.float32
        assert isinstance(batch["im_files"], list)


@pytest.mark.gpu
def test_stream_safety_under_a_slow_consumer():
    # A long kernel on the consumer stream, then a read of the batch queued behind it; the
    # batch is dropped at once (its read still queued) while later batches are copied: neither
    # a slot nor a freed batch's memory may be reused under a read. What each read saw is
    # compared with torch's batches on the host afterwards.
    expected = list(DataLoader(TensorDataset(n=96, shape=(3, 64, 64)), batch_size=8, num_workers=2))
    loader = FastLoader(TensorDataset(n=96, shape=(3, 64, 64)), batch_size=8, num_workers=2,
                        device="cuda", prefetch_depth=4, ring_slots=8)
    big = torch.randn(4096, 4096, device="cuda")
    seen = []
    for batch in loader:
        for _ in range(4):
            big = big @ big / 64  # keeps the consumer stream busy
        seen.append(tuple(t.clone() for t in batch))
    torch.cuda.synchronize()
    assert_same([tuple(t.cpu() for t in e) for e in expected],
                [tuple(t.cpu() for t in s) for s in seen])


@dataclasses.dataclass
class Pair:
    images: torch.Tensor
    labels: torch.Tensor


def collate_pair(samples):
    return Pair(torch.stack([image for image, _ in samples]),
                torch.tensor([label for _, label in samples]))


@pytest.mark.gpu
def test_a_dataclass_batch_arrives_on_the_device():
    dataset = TensorDataset(n=64, shape=(3, 32, 32))
    loader = FastLoader(dataset, batch_size=8, num_workers=2, device="cuda",
                        collate_fn=collate_pair)
    expected = list(DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=collate_pair))
    seen = []
    for batch in loader:
        assert isinstance(batch, Pair) and batch.images.is_cuda and batch.labels.is_cuda
        seen.append((batch.images.clone(), batch.labels.clone()))
    torch.cuda.synchronize()
    assert_same([(e.images, e.labels) for e in expected],
                [(i.cpu(), label.cpu()) for i, label in seen])


@pytest.mark.gpu
def test_device_memory_is_flat_across_epochs():
    loader = FastLoader(TensorDataset(n=128, shape=(3, 64, 64)), batch_size=16, num_workers=2,
                        device="cuda", persistent_workers=True, gpu_transform=T.Normalize(key=0))
    readings = []
    for _ in range(6):
        for _batch in loader:
            pass
        del _batch
        torch.cuda.synchronize()
        readings.append(torch.cuda.memory_allocated())
    assert readings[-1] <= readings[1]
    assert loader._device_stage.copy_stream is not None  # one stream for all epochs


@pytest.mark.gpu
def test_pin_memory_batches_are_pinned_copies():
    # pin_memory=True: the user copies, so batches are copied into torch's pinned pool (the
    # only pinned memory torch guards), never handed out as views of a slot, and the slots
    # stay pageable.
    loader = FastLoader(TensorDataset(n=64), batch_size=4, num_workers=2, pin_memory=True,
                        persistent_workers=True)
    list(loader)
    for batch in loader:
        for tensor in batch:
            address = tensor.data_ptr()
            assert tensor.is_pinned()
            assert not any(s.address <= address < s.address + s.nbytes
                           for s in loader._planner.slot_pool._slots.values())
    slots = loader._planner.slot_pool._slots.values()
    assert not any(torch.from_numpy(s.memory).is_pinned() for s in slots)


@pytest.mark.gpu
def test_device_slots_are_page_locked():
    # device="cuda": fastfeed copies from the slots themselves, which must be page-locked
    # (cudaHostRegister), or the "non_blocking" copies would be synchronous.
    loader = FastLoader(TensorDataset(n=64), batch_size=4, num_workers=2, device="cuda",
                        persistent_workers=True)
    for _ in range(2):
        list(loader)
    slots = list(loader._planner.slot_pool._slots.values())
    assert slots and all(slot.page_locked for slot in slots)
    assert all(torch.from_numpy(slot.memory).is_pinned() for slot in slots)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_without_batching_each_item_counts_as_one_sample_with_a_device(num_workers):
    """batch_size=None: each item is one sample in the stats, with a device as without (a
    3×8×8 item is not three samples)."""
    counts = []
    for device in (None, "cpu"):
        loader = FastLoader(TensorDataset(n=8), batch_size=None, num_workers=num_workers,
                            device=device)
        assert len(list(loader)) == 8
        counts.append(loader.stats().samples)
    assert counts == [8, 8]
