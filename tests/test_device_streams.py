"""The device stage's CUDA rules on the modelled device (``cuda_model``): what each stream may
read and when, which memory the caching allocator may hand out again, which leaves the copy
must reach, and that nothing in the batch path makes the host wait for the GPU. Each test runs
FastLoader's real copy path; the device runs only when the test says, in the order that would
expose a broken rule."""

import dataclasses
import functools
import threading

import cuda_model
import pytest
import torch
from helpers import assert_same
from sample_datasets import TensorDataset
from torch.utils.data import DataLoader, Dataset, default_collate, get_worker_info

from fastfeed import FastLoader
from fastfeed.device import StreamCopier
from fastfeed.device.prefetch import DeviceIterator
from fastfeed.iterators import HostBatch
from fastfeed.telemetry import Telemetry
from fastfeed.tree import map_tensors


@pytest.fixture
def gpu(monkeypatch):
    return cuda_model.install(monkeypatch, cuda_model.Gpu())


def on_host(gpu, batches):
    return [map_tensors(gpu.read, batch) for batch in batches]


def reference(dataset, collate_fn=None, batch_size=4):
    return list(DataLoader(dataset, batch_size=batch_size, num_workers=2, collate_fn=collate_fn))


# -- the consumer's stream and the caching allocator ---------------------------------------------

def consume(loader):
    """A training loop: each step reads its batch on the current stream (a kernel still queued
    when the loop drops the batch for the next one)."""
    return [batch[0].clone() for batch in loader]


def test_a_batch_the_consumer_still_reads_is_not_handed_to_later_copies(gpu):
    dataset = TensorDataset(n=48, shape=(3, 8, 8))
    loader = FastLoader(dataset, batch_size=4, num_workers=2, device="cuda")
    seen = consume(loader)
    gpu.run(loader._device_stage.copy_stream)  # the copy stream runs ahead of the consumer's
    assert_same([batch[0] for batch in reference(dataset)], on_host(gpu, seen))


def test_the_model_shows_reuse_after_free_without_record_stream(gpu, monkeypatch):
    # The stand-in can fail: without record_stream, a freed batch goes back to the copy
    # stream's pool at once, and a later copy overwrites it under the consumer's read.
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: None)
    dataset = TensorDataset(n=48, shape=(3, 8, 8))
    loader = FastLoader(dataset, batch_size=4, num_workers=2, device="cuda")
    seen = consume(loader)
    gpu.run(loader._device_stage.copy_stream)
    want = [batch[0] for batch in reference(dataset)]
    assert any(not torch.equal(w, g) for w, g in zip(want, on_host(gpu, seen), strict=True))


# -- every leaf the codec wrote into the slot -----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Pair:
    images: torch.Tensor
    labels: torch.Tensor


class Holder:
    """A container tree.py does not know (as an attrs class or PyG's Batch): it pickles."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels


class Sealed(Holder):
    """A container that pickles in a worker but refuses it in the main process."""

    def __reduce__(self):
        if get_worker_info() is None:
            raise TypeError("sealed outside a worker")
        return Sealed, (self.images, self.labels)


def collate_into(kind, samples):
    # Made outside the slot: the codec writes both into it.
    return kind(torch.stack([image for image, _ in samples]),
                torch.tensor([label for _, label in samples]))


# Partials of module-level names: workers started by pickling (forkserver, spawn) get them too.
collate_pair, collate_holder, collate_sealed = (functools.partial(collate_into, kind)
                                                for kind in (Pair, Holder, Sealed))


@pytest.mark.parametrize("collate", [collate_pair, collate_holder], ids=["dataclass", "object"])
def test_every_tensor_of_any_container_reaches_the_device(gpu, collate):
    # The user copies what they get (a no-op for a device tensor; for a host view of the slot,
    # a copy queued behind the slot's fence, which the slot pool no longer waits for).
    dataset = TensorDataset(n=48, shape=(3, 8, 8))
    loader = FastLoader(dataset, batch_size=4, num_workers=2, device="cuda", collate_fn=collate,
                        persistent_workers=True)
    list(loader)  # the slot pool learns the batch size
    gpu.run()
    got = [(batch.images.to("cuda", non_blocking=True), batch.labels.to("cuda",
                                                                         non_blocking=True))
           for batch in loader]
    assert gpu.syncs_in("MainThread") == []
    gpu.run()
    want = [(b.images, b.labels) for b in reference(dataset, collate)]
    assert_same(want, on_host(gpu, got))


def test_a_batch_whose_slot_tensors_cannot_be_reached_is_refused(gpu):
    loader = FastLoader(TensorDataset(n=8), batch_size=4, num_workers=2, device="cuda",
                        collate_fn=collate_sealed)
    with pytest.raises(TypeError, match=r"cannot reach \d+ tensor\(s\) of a batch of type Sealed"):
        next(iter(loader))


def test_a_gpu_transform_that_returns_any_container_is_handed_over_whole(gpu):
    dataset = TensorDataset(n=48, shape=(3, 8, 8))
    loader = FastLoader(dataset, batch_size=4, num_workers=2, device="cuda",
                        gpu_transform=lambda batch: Holder(batch[0] + 1, batch[1]))
    seen = [batch.images.clone() for batch in loader]
    gpu.run(loader._device_stage.copy_stream)
    assert_same([batch[0] + 1 for batch in reference(dataset)], on_host(gpu, seen))


# -- what a host batch may hold --------------------------------------------------------------------

class MadeOnTheDevice(Dataset):
    """A dataset that makes CUDA tensors (read with num_workers=0), on the current stream."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((3, 4), float(i), device="cuda") * 2


def test_device_tensors_in_a_host_batch_are_read_after_the_stream_that_made_them(gpu):
    loader = FastLoader(MadeOnTheDevice(), batch_size=4, device="cuda",
                        gpu_transform=lambda batch: batch + 1)
    got = list(loader)
    # the copy stream first: it must wait for the default one
    gpu.run(loader._device_stage.copy_stream)
    want = [torch.arange(i, i + 4, dtype=torch.float32).view(4, 1, 1).expand(4, 3, 4) * 2 + 1
            for i in range(0, 16, 4)]
    assert_same(want, on_host(gpu, got))


def strided(samples):
    images, labels = default_collate(samples)
    return images[:, :, ::2], labels  # in the slot as it is: a view that skips every other row


def test_a_view_with_gaps_is_staged_not_copied_synchronously(gpu):
    # The copy engine reads a span of memory: torch copies a view with gaps through a
    # contiguous pageable temporary, a synchronous copy, page-locked source or not.
    dataset = TensorDataset(n=32, shape=(3, 8, 8))
    loader = FastLoader(dataset, batch_size=4, num_workers=2, device="cuda", collate_fn=strided,
                        persistent_workers=True, ring_slots=12)
    list(loader)
    gpu.run()
    gpu.syncs.clear()
    got = list(loader)
    assert gpu.syncs_in("MainThread") == []
    gpu.run()
    assert_same(reference(dataset, strided), on_host(gpu, got))


# -- the host never waits for the device -----------------------------------------------------

class HostReads:
    """A gpu_transform that reads a device value on the host, as a stray .item() would."""

    def __call__(self, batch):
        return batch if batch[0].float().mean().item() > -1 else None


def test_the_sync_detector_counts_a_host_read_anywhere_in_the_batch_path(gpu):
    loader = FastLoader(TensorDataset(n=16), batch_size=4, num_workers=2, device="cuda",
                        gpu_transform=HostReads())
    list(loader)
    assert gpu.syncs_in("MainThread") == ["Tensor.item()"] * 4


def test_copies_and_hand_over_make_no_host_sync(gpu):
    loader = FastLoader(TensorDataset(n=32), batch_size=4, num_workers=2, device="cuda",
                        gpu_transform=lambda batch: (batch[0].float() / 255, batch[1]))
    for images, _ in loader:
        (images * 2).sum()
    assert gpu.syncs == []


def test_a_host_blocking_transform_runs_off_the_training_thread(gpu):
    class Waits:
        blocks_host = True  # as torchvision's JPEG decoder: it synchronises its own stream

        def __init__(self):
            self.stream = torch.cuda.Stream()

        def __call__(self, batch):
            self.stream.synchronize()
            return batch

    dataset = TensorDataset(n=32)
    loader = FastLoader(dataset, batch_size=4, num_workers=2, device="cuda",
                        gpu_transform=Waits())
    got = list(loader)
    gpu.run()
    assert_same(reference(dataset), on_host(gpu, got))
    assert gpu.syncs and gpu.syncs_in("MainThread") == []


class ListHost:
    """A host iterator over ``batches`` that notes when it closes (its slots with it)."""

    base_seed = 0

    def __init__(self, batches, events):
        self._batches, self._events, self._at = batches, events, 0

    def next_host_batch(self):
        if self._at == len(self._batches):
            raise StopIteration
        self._at += 1
        return HostBatch(self._batches[self._at - 1], None)

    def position(self):
        return self._at

    def state_at(self, position):
        return position

    def close(self):
        self._events.append("slots closed")

    def __len__(self):
        return len(self._batches)


class SecondCopyHeld:
    """A copier whose second copy runs until released, and notes when it fenced its slot."""

    def __init__(self, events):
        self.events, self.started, self.release = events, threading.Event(), threading.Event()
        self._copies = 0

    def producer(self):
        return None

    def copy(self, host, transform, telemetry, producer):
        self._copies += 1
        if self._copies == 2:
            self.started.set()
            self.release.wait()
            self.events.append("copy fenced")
        return host.batch, None


def test_closing_waits_for_the_copy_on_the_helper_before_the_slots_close():
    # The helper's copy fences its slot as it returns: slots closed before that would be
    # unmapped (and unregistered) under a copy engine still reading them.
    events = []
    copier = SecondCopyHeld(events)
    transform = type("Blocks", (), {"blocks_host": True, "__call__": lambda self, b: b})()
    iterator = DeviceIterator(ListHost([[1], [2], [3]], events), copier, depth=2,
                              transform=transform, telemetry=Telemetry())
    assert next(iterator) == [1]
    assert copier.started.wait(30)
    closing = threading.Thread(target=iterator.close)
    closing.start()
    closing.join(1)  # a close that does not wait has closed the slots by now
    copier.release.set()
    closing.join()
    assert events == ["copy fenced", "slots closed"]


def test_the_ultralytics_pixel_ops_make_no_host_sync_per_batch(gpu):
    from fastfeed.ultralytics import pixel_ops

    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (2, 6, 5, 3), dtype=torch.uint8, generator=generator)
    luts = torch.randint(0, 256, (2, 3, 256), dtype=torch.uint8, generator=generator)
    apply = torch.tensor([True, False])
    want = pixel_ops.hsv_lookup(images, luts, apply)
    on_device = [t.pin_memory().to("cuda", non_blocking=True) for t in (images, luts, apply)]
    try:
        pixel_ops.hsv_lookup(*on_device)  # the first batch makes the per-device tables
        gpu.syncs.clear()
        got = pixel_ops.hsv_lookup(*on_device)
        assert gpu.syncs == []
        gpu.run()
        assert torch.equal(gpu.read(got), want)
    finally:  # the tables hold memory of this test's device
        pixel_ops._sectors.cache_clear()
        pixel_ops._division_table.cache_clear()


def test_a_batch_outside_the_slot_pool_is_staged_through_torchs_pinned_pool(gpu):
    # num_workers=0: nothing to fence; the copy still reads page-locked memory, torch's.
    copier = StreamCopier(torch.device("cuda", 0), torch.cuda.Stream())
    batch, event = copier.copy(HostBatch([torch.arange(4)], None), None, Telemetry())
    assert gpu.staged == 1 and gpu.syncs == [] and not event.query()
    gpu.run()
    assert torch.equal(gpu.read(batch[0]), torch.arange(4))
