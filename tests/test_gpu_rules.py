"""The CUDA rules of the batch path, each held by one small mechanism, checked on a CPU.

No GPU runs these. The slot pool's own rules are checked with events the tests hold incomplete; the
copy path runs for real on the CUDA device that ``cuda_model`` models: a copy reads a slot by
address when its stream runs, so a slot rewritten too early shows up as a wrong batch, and the
runtime behind ``cudaHostRegister`` is the model's (or, for reading its errors back, a real
shared library compiled for the test). Each test fails when its rule is broken.
"""

import contextlib
import ctypes
import gc
import os
import shutil
import subprocess
import threading
import warnings

import cuda_model
import numpy as np
import pytest
import torch
from helpers import assert_same
from sample_datasets import TensorDataset
from torch.utils.data import DataLoader

import fastfeed.slots.pool as pool_module
from fastfeed import FastLoader
from fastfeed.slots import Arena, SlotOwnershipError, SlotPool
from fastfeed.slots.page_lock import PageLocker, TorchCudaRuntime
from fastfeed.tree import map_tensors


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


# -- the slot pool: ownership ----------------------------------------------------------------------

def test_a_double_release_raises_and_cannot_free_another_owners_slot():
    slot_pool = SlotPool(1, slot_bytes=4096)
    first, _, _ = slot_pool.acquire()
    slot_pool.release(first)
    second, _, _ = slot_pool.acquire()
    assert second.slot_id == first.slot_id and second != first
    with pytest.raises(SlotOwnershipError, match="stale ticket"):
        slot_pool.release(first)  # the old owner again: the slot is the second task's now
    assert slot_pool.occupancy == (1, 1)
    assert slot_pool.acquire()[0] is None  # still owned: not handed out twice


def test_a_stale_release_outside_tests_is_logged_and_changes_nothing(monkeypatch, caplog):
    monkeypatch.setattr(pool_module, "STRICT", False)
    slot_pool = SlotPool(1, slot_bytes=4096)
    first, _, _ = slot_pool.acquire()
    slot_pool.release(first)
    slot_pool.acquire()
    slot_pool.release(first)
    assert "stale ticket" in caplog.text
    assert slot_pool.occupancy == (1, 1)


def test_a_lease_returns_its_slot_only_when_the_last_view_dies():
    slot_pool = SlotPool(1, slot_bytes=4096)
    ticket, _, _ = slot_pool.acquire()
    lease = slot_pool.lease(ticket)
    view = torch.from_numpy(lease.memory)[:16]
    del lease
    assert slot_pool.acquire()[0] is None
    del view
    assert slot_pool.acquire()[0] is not None
    with pytest.raises(SlotOwnershipError):
        slot_pool.lease(ticket)  # a ticket is used once


def test_a_lease_dying_while_the_slot_pool_is_locked_does_not_deadlock():
    # The cyclic collector may finalise a lease inside acquire() on the same thread.
    slot_pool = SlotPool(2, slot_bytes=4096)
    lease = slot_pool.lease(slot_pool.acquire()[0])

    def drop_under_lock():
        nonlocal lease
        with slot_pool._lock:
            del lease
            gc.collect()

    thread = threading.Thread(target=drop_under_lock, daemon=True)
    thread.start()
    thread.join(timeout=5)
    assert not thread.is_alive(), "finalising a lease under the slot pool's lock deadlocked"
    assert slot_pool.occupancy == (0, 1)


def worker_slot(nbytes, value):
    """What a worker hands over for a task sent without a slot: a slot of its own, written."""
    arena = Arena.private(nbytes)
    arena.buffer.fill_(value)
    return arena.export_private_slot().detach()


def test_an_adopted_slot_is_leased_to_its_batch_then_handed_out():
    slot_pool = SlotPool(2, slot_bytes=4096)
    lease, created = slot_pool.adopt(worker_slot(4096, 7))
    assert len(created) == 1 and (lease.memory == 7).all()
    assert slot_pool.occupancy == (1, 1)  # leased: not handed out while the batch lives
    assert slot_pool.acquire()[0].slot_id != created[0].slot_id
    del lease
    assert slot_pool.acquire()[0].slot_id == created[0].slot_id


@pytest.mark.parametrize("why", ["full", "too small", "closed"])
def test_a_slot_the_pool_cannot_keep_serves_its_batch_alone(why):
    slot_pool = SlotPool(1, slot_bytes=8192 if why == "too small" else 4096)
    if why == "full":
        slot_pool.acquire()
    if why == "closed":
        slot_pool.close()
    before = slot_pool.occupancy
    lease, created = slot_pool.adopt(worker_slot(4096, 3))
    assert created == [] and slot_pool.occupancy == before
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
        slot_pool = SlotPool(2, pin=PageLocker(0, runtime=RefusingRuntime()), slot_bytes=4096)
        expected = RuntimeError
    else:
        monkeypatch.setattr(pool_module, "available_memory", lambda: 4096)  # over half of it
        slot_pool = SlotPool(2, slot_bytes=4096)
        expected = RuntimeWarning
    fd = worker_slot(4096, 1)
    before = open_memfds()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(expected):
            slot_pool.adopt(fd)
    assert open_memfds() == before - 1
    assert slot_pool.occupancy == (0, 0)


# -- the slot pool: copies it cannot see -----------------------------------------------------------

def test_a_fenced_slot_is_not_reused_until_its_copy_completes():
    slot_pool = SlotPool(1, slot_bytes=4096)
    ticket, _, _ = slot_pool.acquire()
    lease = slot_pool.lease(ticket)
    event = HeldEvent()
    lease.fence(event)
    del lease
    assert slot_pool.acquire()[0] is None  # the batch is gone, the copy is not
    event.complete()
    assert slot_pool.acquire()[0] is not None


def test_closing_the_slot_pool_waits_for_copies_still_reading_it():
    slot_pool = SlotPool(1, slot_bytes=4096)
    lease = slot_pool.lease(slot_pool.acquire()[0])
    event = HeldEvent()
    lease.fence(event)
    slot_pool.close()
    assert event.done


@pytest.fixture
def gpu(monkeypatch):
    return cuda_model.install(monkeypatch, cuda_model.Gpu())


def on_host(gpu, batches):
    return [map_tensors(gpu.read, batch) for batch in batches]


@pytest.mark.parametrize("abandon", [False, True])
def test_no_slot_is_rewritten_under_a_queued_copy(gpu, abandon):
    # The device runs nothing until the end: every copy stays queued while the workers go on
    # writing batches into whatever slot the slot pool hands out, this epoch and the next. The
    # bytes each copy finally reads must be its own batch's.
    dataset = TensorDataset(n=96, shape=(3, 16, 16))
    expected = list(DataLoader(dataset, batch_size=4, num_workers=2))
    loader = FastLoader(dataset, batch_size=4, num_workers=2, ring_slots=3, device="cuda",
                        persistent_workers=True)
    got = []
    for i, batch in enumerate(loader):
        got.append(batch)
        if abandon and i == 10:
            break
    used, allocated = loader._planner.slot_pool.occupancy
    assert used == allocated  # every slot a copy read is still fenced
    gc.collect()
    again = list(loader)
    gpu.run()
    assert_same(expected[:len(got)], on_host(gpu, got))
    assert_same(expected, on_host(gpu, again))
    assert gpu.syncs_in("MainThread") == []
    assert loader._planner.slot_pool.occupancy[0] == 0


def test_the_model_shows_a_slot_rewritten_under_a_copy_nothing_fences(gpu, monkeypatch):
    # The stand-in can fail: without the fence, the slot pool hands a slot out again while its copy
    # is queued, and the copy reads the next batch's bytes.
    monkeypatch.setattr(pool_module.Lease, "fence", lambda self, fence: None)
    dataset = TensorDataset(n=48, shape=(3, 16, 16))
    loader = FastLoader(dataset, batch_size=4, num_workers=2, ring_slots=3, device="cuda")
    got = list(loader)
    gpu.run()
    expected = list(DataLoader(dataset, batch_size=4, num_workers=2))
    assert any(not torch.equal(e[0], g[0]) for e, g in zip(expected, on_host(gpu, got),
                                                          strict=True))


# -- which memory each copy reads ---------------------------------------------------------------

def slot_holding(loader, tensor):
    address = tensor.data_ptr()
    slots = loader._planner.slot_pool._slots.values()
    return any(s.address <= address < s.address + s.nbytes for s in slots)


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")
def test_pin_memory_batches_are_copies_in_torchs_pool_never_the_slot(gpu):
    # The user copies these, on any stream: only memory of torch's pinned pool is guarded by
    # torch's events, so the batch must be a copy there, never a view of a slot.
    loader = FastLoader(TensorDataset(n=32), batch_size=4, num_workers=2, pin_memory=True,
                        persistent_workers=True)
    for _epoch in range(2):
        for images, labels in loader:
            assert images.is_pinned() and labels.is_pinned()
            assert not slot_holding(loader, images) and not slot_holding(loader, labels)
    assert not gpu.registered  # and the slots are not page-locked


@pytest.mark.parametrize("refused", [False, True])
def test_a_slot_is_read_in_place_only_where_it_is_page_locked(gpu, refused):
    # A registered slot is read by the copy engine where it lies; one whose registration
    # failed is staged through torch's pinned pool (guarded by torch), never copied
    # synchronously from pageable memory. Either way the batches are right.
    gpu.runtime.refuse = refused
    dataset = TensorDataset(n=32, shape=(3, 8, 8))
    loader = FastLoader(dataset, batch_size=4, num_workers=2, device="cuda",
                        persistent_workers=True, ring_slots=12)
    list(loader)  # the slot pool learns the batch size and registers its slots
    gpu.run()
    gpu.staged = 0
    got = list(loader)
    gpu.run()
    assert_same(list(DataLoader(dataset, batch_size=4, num_workers=2)), on_host(gpu, got))
    assert gpu.syncs_in("MainThread") == []
    assert (gpu.staged > 0) == refused


# -- pinning -------------------------------------------------------------------------------------

class RecordingRuntime:
    def __init__(self, error=0, readable=True):
        self.error, self.readable = error, readable
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

    def clear_error(self, error):
        self.calls.append(("clear_error", self.current))
        return self.readable


def test_registration_runs_on_the_loaders_gpu_and_is_undone_there():
    runtime = RecordingRuntime()
    memory = np.zeros(4096, np.uint8)
    assert PageLocker(2, runtime).register(memory)
    del memory
    gc.collect()
    assert runtime.calls == [("register", 2), ("unregister", 2)]


def test_a_failed_registration_is_read_back_and_reported_once(caplog):
    runtime = RecordingRuntime(error=1)
    pinner = PageLocker(1, runtime)
    assert not pinner.register(np.zeros(4096, np.uint8))
    assert not pinner.register(np.zeros(4096, np.uint8))
    assert runtime.calls == [("register", 1), ("clear_error", 1)] * 2
    assert caplog.text.count("cudaHostRegister failed") == 1


def test_an_error_no_runtime_holds_stops_registration(caplog):
    # A runtime linked in statically: the error cannot be read back, so no slot is registered
    # again (each failure would leave one more for torch to report against a kernel).
    runtime = RecordingRuntime(error=1, readable=False)
    pinner = PageLocker(0, runtime)
    assert not pinner.register(np.zeros(4096, np.uint8))
    assert not pinner.register(np.zeros(4096, np.uint8))
    assert runtime.calls == [("register", 0), ("clear_error", 0)]
    assert "no CUDA runtime library" in caplog.text


FAKE_CUDART = """
static __thread int last_error = 0;
int cudaHostRegister(void *ptr, unsigned long size, unsigned flags) { last_error = 1; return 1; }
int cudaHostUnregister(void *ptr) { return 0; }
int cudaPeekAtLastError(void) { return last_error; }
int cudaGetLastError(void) { int error = last_error; last_error = 0; return error; }
"""


@pytest.fixture(scope="module")
def two_runtimes(tmp_path_factory):
    """Two CUDA runtimes mapped into this process, as CuPy's or TensorRT's beside torch's: the
    first in path order is not the one torch's bindings call."""
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in CUDA runtimes")
    root = tmp_path_factory.mktemp("cudart")
    source = root / "cudart.c"
    source.write_text(FAKE_CUDART)
    runtimes = []
    for owner in ("a-another-package", "z-torch"):
        (root / owner).mkdir()
        library = root / owner / "libcudart.so.12"
        subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)],
                       check=True)
        runtimes.append(ctypes.CDLL(str(library)))
    return runtimes


def test_a_failed_registration_is_read_back_in_the_runtime_that_holds_it(two_runtimes,
                                                                         monkeypatch):
    _, torchs = two_runtimes  # the other, first in path order, is not torch's

    class TorchBindings:  # torch.cuda.cudart(): linked against torch's runtime
        cudaHostRegister = torchs.cudaHostRegister
        cudaHostUnregister = torchs.cudaHostUnregister

    monkeypatch.setattr(torch.cuda, "cudart", TorchBindings)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    assert not PageLocker(0, TorchCudaRuntime()).register(np.zeros(4096, np.uint8))
    # Left set, torch's next kernel-launch check would report it against an unrelated kernel.
    assert torchs.cudaPeekAtLastError() == 0
