"""``pin_memory=True`` without ``device=``: batches are copied into pinned memory ahead of the
consumer, on a helper thread, as torch's pin-memory thread copies them (in ``next()`` with
``num_workers=0``, as torch does).

``pin_memory()`` needs CUDA, so on the CPU a stand-in takes its place: a real copy of every
tensor, slowed down, which records the thread it runs on. It copies each tensor in two halves
with a pause between them, so a slot handed out again during a copy shows up as a torn batch.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from helpers import assert_same, compare, outcomes
from sample_datasets import FailingDataset, MixedDataset, TensorDataset
from torch.utils.data import DataLoader

import fastfeed.device.pinned
from fastfeed import FastLoader
from fastfeed.device.pinned import PinnedIterator
from fastfeed.tree import map_tensors

pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")


class StandInPin:
    """torch's ``pin_memory`` on a machine without CUDA: a copy of every tensor, in two halves
    with ``pause`` seconds between them. Records the thread of each call, and checks that the
    pool slot a tensor lives in (if any) stays leased to its batch while it is copied."""

    def __init__(self, pause: float) -> None:
        self.pause = pause
        self.threads: list[int] = []
        self.slot_pool = None  # set by the test: the slot pool whose slots are checked
        self.reused_during_copy = 0

    def __call__(self, batch):
        self.threads.append(threading.get_ident())
        return map_tensors(self._copy, batch)

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(tensor)
        half = len(tensor) // 2 if tensor.dim() else 0
        out[:half].copy_(tensor[:half])
        time.sleep(self.pause)
        self._check_leased(tensor)
        out[half:].copy_(tensor[half:])
        return out

    def _check_leased(self, tensor: torch.Tensor) -> None:
        if self.slot_pool is None or not tensor.numel():
            return
        address = tensor.data_ptr()
        for slot in list(self.slot_pool._slots.values()):
            if slot.address <= address < slot.address + slot.nbytes:
                self.reused_during_copy += slot.state.value != "leased"


@pytest.fixture
def pin(monkeypatch):
    """CUDA "available", and the stand-in in place of torch's pinned copy: fastfeed's, and the
    stock loader's (its own, pause-free), which would otherwise pin for real on a CUDA build of
    torch and find no driver, or pin nothing on a CPU build."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    stand_in = StandInPin(pause=0.004)
    monkeypatch.setattr(fastfeed.device.pinned, "pin_batch", stand_in)
    stock_pin = StandInPin(pause=0)
    monkeypatch.setattr(torch.utils.data._utils.pin_memory, "pin_memory",
                        lambda data, device=None: stock_pin(data))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda *args: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    return stand_in


def pin_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "fastfeed-pin"]


def test_a_slower_consumer_never_makes_the_pinned_copy(pin):
    """The copies run on the helper thread, never in the training thread's next()."""
    loader = FastLoader(TensorDataset(n=64), batch_size=4, num_workers=2, pin_memory=True)
    iterator = iter(loader)
    assert isinstance(iterator, PinnedIterator)
    batches = []
    for batch in iterator:
        time.sleep(3 * pin.pause)  # the training step, slower than the copy
        batches.append(batch)
    assert len(pin.threads) == len(batches) == 16
    assert threading.get_ident() not in pin.threads


def test_without_workers_the_batch_is_pinned_in_next_as_torch_does(pin):
    loader = FastLoader(TensorDataset(n=16), batch_size=4, pin_memory=True)
    assert len(list(loader)) == 4
    assert pin.threads == [threading.get_ident()] * 4


@pytest.mark.parametrize(("dataset", "options"), [
    (MixedDataset, {"num_workers": 2, "shuffle": True, "generator": 3}),
    (MixedDataset, {"num_workers": 2, "persistent_workers": True, "epochs": 2}),
    # threads share the global RNGs, which MixedDataset draws from
    (TensorDataset, {"num_workers": 2, "fast": {"worker_mode": "thread"}}),
    (MixedDataset, {"num_workers": 0}),
], ids=["processes", "persistent", "threads", "main-process"])
def test_batches_equal_the_stock_loaders(pin, dataset, options):
    options = dict(options)
    epochs = options.pop("epochs", 1)
    assert compare(dataset, epochs=epochs, batch_size=4, pin_memory=True, **options)


def test_no_slot_is_reused_while_its_pinned_copy_runs(pin):
    """Two slots and workers that wait for none: a slot handed back before its copy ended
    would be rewritten during the pause, and the batch would come out torn."""
    kwargs = {"batch_size": 8, "num_workers": 2, "shuffle": True}
    torch.manual_seed(1)
    expected = list(DataLoader(TensorDataset(n=256), **kwargs))
    loader = FastLoader(TensorDataset(n=256), pin_memory=True, ring_slots=2, **kwargs)
    torch.manual_seed(1)
    iterator = iter(loader)
    pin.slot_pool = loader._planner.slot_pool
    assert_same(expected, list(iterator))
    assert pin.slot_pool is not None and pin.slot_pool.occupancy[1] > 0, "no batch in a slot"
    assert pin.reused_during_copy == 0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_errors_come_in_their_batch_turn_and_iteration_goes_on(pin, num_workers):
    kwargs = {"batch_size": 2, "num_workers": num_workers, "pin_memory": True}
    expected = outcomes(DataLoader(FailingDataset(bad=5), **kwargs))
    assert outcomes(FastLoader(FailingDataset(bad=5), **kwargs)) == expected
    assert any(kind == "error" for kind, *_ in expected)


def test_a_snapshot_is_of_the_batches_delivered_not_those_pinned_ahead(pin):
    kwargs = {"batch_size": 4, "shuffle": True, "num_workers": 2, "pin_memory": True}
    torch.manual_seed(7)
    expected = list(DataLoader(TensorDataset(), **kwargs))
    torch.manual_seed(7)
    first = FastLoader(TensorDataset(), **kwargs)
    iterator = iter(first)
    head = [next(iterator) for _ in range(3)]
    time.sleep(0.2)  # let the helper pin the next ones
    state = first.state_dict()
    iterator.close()
    second = FastLoader(TensorDataset(), **kwargs)
    second.load_state_dict(state)
    assert_same(expected, head + list(second))


def test_a_break_then_the_next_epoch_of_persistent_workers(pin):
    """The helper of an abandoned epoch lets go of the iterator persistent workers reuse,
    before it starts the next epoch: that epoch equals the stock loader's."""
    def two_epochs(loader):
        torch.manual_seed(0)
        for i, _ in enumerate(loader):
            if i == 2:
                break
        return list(loader)

    kwargs = {"batch_size": 4, "num_workers": 2, "persistent_workers": True, "shuffle": True,
              "generator": torch.Generator().manual_seed(5), "pin_memory": True}
    expected = two_epochs(DataLoader(TensorDataset(), **kwargs))
    kwargs["generator"] = torch.Generator().manual_seed(5)
    assert_same(expected, two_epochs(FastLoader(TensorDataset(), **kwargs)))


def test_break_del_and_close_leave_no_thread(pin):
    """A dropped iterator's helper is joined, as torch joins its pin thread: a helper left
    inside a copy when the interpreter finalizes aborts the process (pthread_exit unwinding
    through C++ frames). The copies pause long enough that the helper is inside one at the
    break."""
    pin.pause = 0.2
    loader = FastLoader(TensorDataset(n=64), batch_size=4, num_workers=2, pin_memory=True)
    for _ in range(3):
        for i, _batch in enumerate(loader):
            if i == 1:
                break
        assert not pin_threads()  # joined as the loop let the iterator go
    del _batch
    iterator = iter(loader)
    next(iterator)
    pids = [worker.pid for worker in iterator._workers]
    assert len(pids) == 2  # what Ultralytics' InfiniteDataLoader.close() reaches for
    iterator.close()
    assert not pin_threads()  # joined
    assert all(not worker.is_alive() for worker in iterator._workers)
    del iterator
    gc.collect()


def test_close_gets_the_helper_out_before_the_workers_stop(pin, monkeypatch):
    """close() while the helper is dispatching a task: the helper leaves the pool first (its
    next wait interrupted), then the pool shuts down, so nothing is dispatched to workers being
    shut down, nor is the task book changed under the shutdown's walk of it; no worker or
    thread is left behind, and every slot comes back."""
    from fastfeed.iterators.crew import WorkerCrew
    from fastfeed.iterators.tasks import TaskBook

    armed, dispatching = threading.Event(), threading.Event()
    shutting_down: set[int] = set()
    late_sends: list[int] = []
    book_send, send, shutdown = TaskBook.send, WorkerCrew.send, WorkerCrew.shutdown

    def slow_book_send(self, worker_id, ticket):
        if threading.current_thread().name == "fastfeed-pin" and armed.is_set() \
                and not dispatching.is_set():
            dispatching.set()
            time.sleep(0.3)  # the helper is inside the pool while close() is called
        return book_send(self, worker_id, ticket)

    def recorded_send(self, worker_id, message):
        if id(self) in shutting_down:
            late_sends.append(worker_id)
        return send(self, worker_id, message)

    def recorded_shutdown(self, wait=True):
        shutting_down.add(id(self))
        return shutdown(self, wait)

    monkeypatch.setattr(TaskBook, "send", slow_book_send)
    monkeypatch.setattr(WorkerCrew, "send", recorded_send)
    monkeypatch.setattr(WorkerCrew, "shutdown", recorded_shutdown)
    loader = FastLoader(TensorDataset(n=64), batch_size=2, num_workers=2, pin_memory=True)
    iterator = iter(loader)
    next(iterator)
    time.sleep(0.5)  # the helper has pinned as far ahead as it may, and waits
    armed.set()
    next(iterator)  # the helper pulls the next batch, and dispatches a task in its place
    assert dispatching.wait(10)
    iterator.close()
    assert not pin_threads()
    assert all(not worker.is_alive() for worker in iterator._workers)
    slot_pool = loader._planner.slot_pool
    del iterator, loader  # batches received but not delivered hold their slots till then
    gc.collect()
    assert late_sends == []
    assert slot_pool is not None and slot_pool.occupancy[0] == 0, slot_pool.occupancy
