"""The CUDA rules of the batch path, each held by one small mechanism, checked on a CPU.

No GPU runs these: events are objects the tests hold incomplete, the copy engine is a fake
that reads raw memory only when its event completes (as DMA would), and the CUDA runtime of
the pinning code is a recorder. Each test fails when its rule is broken.
"""

import contextlib
import ctypes
import gc
import os
import threading
import warnings

import numpy as np
import pytest
import torch
from helpers import assert_same
from sample_datasets import TensorDataset
from torch.utils.data import DataLoader

import fastfeed.ring.slots as ring_module
from fastfeed import FastLoader
from fastfeed.device import DeviceIterator, StreamCopier, pinned_source
from fastfeed.pinning import Pinner
from fastfeed.ring import Arena, SlotOwnershipError, SlotRing
from fastfeed.telemetry import Telemetry


class HeldEvent:
    """An event the test completes by hand; ``synchronize`` is a host sync, so it is loud."""

    def __init__(self, on_complete=None):
        self.done = False
        self._on_complete = on_complete

    def query(self):
        return self.done

    def complete(self):
        if not self.done and self._on_complete is not None:
            self._on_complete()
        self.done = True

    def synchronize(self):
        self.complete()


# -- the ring: ownership ------------------------------------------------------------------------

def test_a_double_release_raises_and_cannot_free_another_owners_slot():
    ring = SlotRing(1, slot_bytes=4096)
    first, _, _ = ring.acquire()
    ring.release(first)
    second, _, _ = ring.acquire()
    assert second.slot_id == first.slot_id and second != first
    with pytest.raises(SlotOwnershipError, match="stale ticket"):
        ring.release(first)  # the old owner again: the slot is the second task's now
    assert ring.occupancy == (1, 1)
    assert ring.acquire()[0] is None  # still owned: not handed out twice


def test_a_stale_release_outside_tests_is_logged_and_changes_nothing(monkeypatch, caplog):
    monkeypatch.setattr(ring_module, "STRICT", False)
    ring = SlotRing(1, slot_bytes=4096)
    first, _, _ = ring.acquire()
    ring.release(first)
    ring.acquire()
    ring.release(first)
    assert "stale ticket" in caplog.text
    assert ring.occupancy == (1, 1)


def test_a_lease_returns_its_slot_only_when_the_last_view_dies():
    ring = SlotRing(1, slot_bytes=4096)
    ticket, _, _ = ring.acquire()
    lease = ring.lease(ticket)
    view = torch.from_numpy(lease.memory)[:16]
    del lease
    assert ring.acquire()[0] is None
    del view
    assert ring.acquire()[0] is not None
    with pytest.raises(SlotOwnershipError):
        ring.lease(ticket)  # a ticket is used once


def test_a_lease_dying_while_the_ring_is_locked_does_not_deadlock():
    # The cyclic collector may finalise a lease inside acquire() on the same thread.
    ring = SlotRing(2, slot_bytes=4096)
    lease = ring.lease(ring.acquire()[0])

    def drop_under_lock():
        nonlocal lease
        with ring._lock:
            del lease
            gc.collect()

    thread = threading.Thread(target=drop_under_lock, daemon=True)
    thread.start()
    thread.join(timeout=5)
    assert not thread.is_alive(), "finalising a lease under the ring's lock deadlocked"
    assert ring.occupancy == (0, 1)


def worker_slot(nbytes, value):
    """What a worker hands over for a task sent without a slot: a slot of its own, written."""
    arena = Arena.private(nbytes)
    arena.buffer.fill_(value)
    return arena.export_private_slot().detach()


def test_an_adopted_slot_is_leased_to_its_batch_then_handed_out():
    ring = SlotRing(2, slot_bytes=4096)
    lease, created = ring.adopt(worker_slot(4096, 7))
    assert len(created) == 1 and (lease.memory == 7).all()
    assert ring.occupancy == (1, 1)  # leased: not handed out while the batch lives
    assert ring.acquire()[0].slot_id != created[0].slot_id
    del lease
    assert ring.acquire()[0].slot_id == created[0].slot_id


@pytest.mark.parametrize("why", ["full", "too small", "closed"])
def test_a_slot_the_ring_cannot_keep_serves_its_batch_alone(why):
    ring = SlotRing(1, slot_bytes=8192 if why == "too small" else 4096)
    if why == "full":
        ring.acquire()
    if why == "closed":
        ring.close()
    before = ring.occupancy
    lease, created = ring.adopt(worker_slot(4096, 3))
    assert created == [] and ring.occupancy == before
    assert (lease.memory == 3).all()


class RefusingRuntime:
    """A CUDA runtime whose registration raises (a driver error surfacing as an exception)."""

    device = staticmethod(lambda index: contextlib.nullcontext())

    def host_register(self, address, nbytes):
        raise RuntimeError("CUDA driver error")


def open_memfds():
    names = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sum("memfd:fastfeed" in name for name in names)


@pytest.mark.parametrize("failure", ["warning raised as an error", "registration raises"])
def test_a_slot_that_fails_adoption_closes_its_descriptor(monkeypatch, failure):
    if failure == "registration raises":
        ring = SlotRing(2, pin=Pinner(0, runtime=RefusingRuntime()), slot_bytes=4096)
        expected = RuntimeError
    else:
        monkeypatch.setattr(ring_module, "available_memory", lambda: 4096)  # over half of it
        ring = SlotRing(2, slot_bytes=4096)
        expected = RuntimeWarning
    fd = worker_slot(4096, 1)
    before = open_memfds()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(expected):
            ring.adopt(fd)
    assert open_memfds() == before - 1
    assert ring.occupancy == (0, 0)


# -- the ring: copies it cannot see ------------------------------------------------------------

def test_a_fenced_slot_is_not_reused_until_its_copy_completes():
    ring = SlotRing(1, slot_bytes=4096)
    ticket, _, _ = ring.acquire()
    lease = ring.lease(ticket)
    event = HeldEvent()
    lease.fence(event)
    del lease
    assert ring.acquire()[0] is None  # the batch is gone, the copy is not
    event.complete()
    assert ring.acquire()[0] is not None


def test_closing_the_ring_waits_for_copies_still_reading_it():
    ring = SlotRing(1, slot_bytes=4096)
    lease = ring.lease(ring.acquire()[0])
    event = HeldEvent()
    lease.fence(event)
    ring.close()
    assert event.done


class DmaCopier:
    """A copy engine that reads a ring slot only when its event completes, by address, holding
    no Python reference to the batch: what a ``cudaMemcpyAsync`` queued behind other work
    does. Memory outside the ring is staged at once, as ``pinned_source`` stages it into
    torch's pinned pool."""

    def __init__(self, ring):
        self.ring = ring
        self.events = []

    def in_slot(self, tensor):
        address = tensor.data_ptr()
        return any(s.address <= address < s.address + s.nbytes for s in self.ring._slots.values())

    def copy(self, host_batch, transform, telemetry):
        holder = [None] * len(host_batch)
        queued = []
        for i, tensor in enumerate(host_batch):
            if self.in_slot(tensor):
                queued.append((i, tensor.data_ptr(), tensor.shape, tensor.dtype))
            else:
                holder[i] = tensor.clone()

        def read():
            for i, address, shape, dtype in queued:
                raw = bytearray(ctypes.string_at(address, _nbytes(shape, dtype)))
                holder[i] = torch.frombuffer(raw, dtype=dtype).reshape(shape)

        event = HeldEvent(read)
        self.events.append(event)
        return holder, event, [t for t in host_batch if self.in_slot(t)]

    def hand_over(self, batch, event):
        pass


def _nbytes(shape, dtype):
    return int(np.prod(shape)) * dtype.itemsize


@pytest.mark.parametrize("abandon", [False, True])
def test_no_slot_is_rewritten_under_a_queued_copy(abandon):
    # Copies stay queued until the end; workers keep producing meanwhile. Every batch the
    # copy engine finally reads must be the one it was given.
    dataset = TensorDataset(n=96, shape=(3, 16, 16))
    expected = list(DataLoader(dataset, batch_size=4, num_workers=2))
    loader = FastLoader(dataset, batch_size=4, num_workers=2, ring_slots=3,
                        persistent_workers=True)
    list(loader)  # the ring learns the batch size
    copier = DmaCopier(loader._ring)
    device = DeviceIterator(iter(loader), copier, depth=2, transform=None,
                            telemetry=Telemetry())
    got = []
    for i, batch in enumerate(device):
        got.append(batch)
        if abandon and i == 10:
            break
    used, allocated = loader._ring.occupancy
    assert used == allocated  # every slot a copy read is still fenced
    del device
    gc.collect()
    # The next epoch runs while those copies are still queued: it may take any slot the
    # ring hands out, and must not get one a queued copy still reads.
    assert_same(expected, list(loader))
    for event in copier.events:
        event.complete()
    assert_same(expected[:len(got)], got)
    assert loader._ring.occupancy[0] == 0


# -- which memory the user copies from -----------------------------------------------------------

def test_slots_are_page_locked_only_when_fastfeed_owns_the_copy(monkeypatch):
    # With pin_memory=True the user drives the copy (x.cuda(non_blocking=True) on any stream);
    # torch guards only the pinned memory it allocated, so a slot must never be handed out
    # pinned. With device="cuda" fastfeed owns the copy and fences the slot.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    user_copies = FastLoader(TensorDataset(), batch_size=4, num_workers=2, pin_memory=True)
    setup = user_copies._iterator_setup()
    assert setup.ring is not None and setup.ring.pin is None and setup.pin_batches

    fastfeed_copies = FastLoader(TensorDataset(), batch_size=4, num_workers=2, device="cuda",
                                 pin_memory=True)
    fastfeed_copies._target = torch.device("cuda", 1)
    setup = fastfeed_copies._iterator_setup()
    assert setup.ring.pin == Pinner(1) and not setup.pin_batches


def test_copies_read_pinned_memory_and_report_the_slots_they_read(monkeypatch):
    # Pageable sources are staged through torch's pinned pool (which torch guards), pinned
    # ones are read in place and fenced; nothing waits on the GPU.
    pinned = torch.arange(8)
    pageable = torch.arange(8, 16)
    pinned_ids = {id(pinned)}
    staged = []

    def pin_memory(tensor):
        copy = tensor.clone()
        pinned_ids.add(id(copy))
        staged.append(tensor)
        return copy

    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: id(t) in pinned_ids)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)

    class Stream:
        def synchronize(self):
            raise AssertionError("host sync in the copy path")

        def wait_event(self, event):
            self.waited = event

    consumer = Stream()
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: consumer)
    monkeypatch.setattr(torch.cuda, "Event", lambda: HeldEvent())
    monkeypatch.setattr(HeldEvent, "record", lambda self, stream: None, raising=False)

    copier = StreamCopier(torch.device("cpu"), Stream())
    boxes = np.arange(12).reshape(3, 4)  # stands for a numpy leaf in a page-locked slot
    batch, event, read = copier.copy([pinned, pageable, {"boxes": boxes}], None, Telemetry())
    assert [t is pinned for t in read] == [True] and staged == [pageable]
    assert_same(batch[:2], [pinned, pageable])
    # Numpy leaves stay on the host, for the user to copy as they like: not a view of the slot
    assert np.array_equal(batch[2]["boxes"], boxes)
    assert not np.shares_memory(batch[2]["boxes"], boxes)
    copier.hand_over(batch, event)
    assert consumer.waited is event and not event.done
    assert pinned_source(pinned) is pinned


# -- pinning -------------------------------------------------------------------------------------

class RecordingRuntime:
    def __init__(self, error=0):
        self.error = error
        self.current = 0
        self.calls = []

    @contextlib.contextmanager
    def device(self, index):
        previous, self.current = self.current, index
        try:
            yield
        finally:
            self.current = previous

    def host_register(self, address, nbytes):
        self.calls.append(("register", self.current))
        return self.error

    def host_unregister(self, address):
        self.calls.append(("unregister", self.current))

    def clear_error(self):
        self.calls.append(("clear_error", self.current))


def test_registration_runs_on_the_loaders_gpu_and_is_undone_there():
    runtime = RecordingRuntime()
    memory = np.zeros(4096, np.uint8)
    assert Pinner(2, runtime).register(memory)
    del memory
    gc.collect()
    assert runtime.calls == [("register", 2), ("unregister", 2)]


def test_a_failed_registration_is_read_back_and_reported_once(caplog):
    runtime = RecordingRuntime(error=1)
    pinner = Pinner(1, runtime)
    assert not pinner.register(np.zeros(4096, np.uint8))
    assert not pinner.register(np.zeros(4096, np.uint8))
    assert runtime.calls == [("register", 1), ("clear_error", 1)] * 2
    assert caplog.text.count("cudaHostRegister failed") == 1


def test_the_ring_records_which_slots_are_page_locked():
    ring = SlotRing(2, pin=Pinner(0, RecordingRuntime(error=1)), slot_bytes=4096)
    _, created, _ = ring.acquire()
    assert created[0].pinned is False
    ring = SlotRing(2, pin=Pinner(0, RecordingRuntime()), slot_bytes=4096)
    _, created, _ = ring.acquire()
    assert created[0].pinned is True
