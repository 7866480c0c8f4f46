"""Failures are loud and clean (docs/design.md, invariant 5), and behave as torch's do."""

import contextlib
import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import outcomes
from procs import (
    alive,
    assert_no_leaks,
    loader_processes,
    new_shm,
    shm_entries,
    snapshot,
    wait_until,
)
from sample_datasets import (
    FailingDataset,
    SlowDataset,
    SuicideDataset,
    TensorDataset,
    failing_collate,
    failing_worker_init,
)
from torch.utils.data import DataLoader

from fastfeed import FastLoader
from fastfeed._install import install_line

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataset_exception_matches_torch_and_iteration_continues(num_workers):
    def build(cls):
        return cls(FailingDataset(bad=5), batch_size=2, num_workers=num_workers)

    expected, got = outcomes(build(DataLoader)), outcomes(build(FastLoader))
    assert got == expected
    assert any(kind == "error" for kind, *_ in got)


def test_exception_carries_worker_traceback():
    with pytest.raises(KeyError) as info:
        list(FastLoader(FailingDataset(bad=0), batch_size=2, num_workers=2))
    text = str(info.value)
    assert "Caught KeyError in DataLoader worker process 0" in text
    assert "bad index 0" in text and "Original Traceback" in text and "__getitem__" in text


@pytest.mark.parametrize("num_workers", [0, 2])
def test_collate_exception(num_workers):
    for cls in (DataLoader, FastLoader):
        with pytest.raises(TypeError, match="collate refuses"):
            next(iter(cls(TensorDataset(), batch_size=2, num_workers=num_workers,
                          collate_fn=failing_collate)))


MAIN_PID = os.getpid()


def _rebuild_outside_main(value):
    if os.getpid() == MAIN_PID and value == 1:
        raise ValueError("cannot be rebuilt in the main process")
    return value


class RebuiltInMain:
    """Pickles from a worker, fails to unpickle in the main process for value 1."""

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return (_rebuild_outside_main, (self.value,))


def _collate_with_rebuilt(samples):
    return torch.stack([s[0] for s in samples]), RebuiltInMain(samples[0][1])


def test_a_batch_that_fails_to_rebuild_raises_in_its_turn_and_iteration_continues():
    loader = FastLoader(TensorDataset(n=4), batch_size=1, num_workers=2,
                        collate_fn=_collate_with_rebuilt)
    outcome = []
    iterator = iter(loader)
    for _ in range(4):
        try:
            outcome.append(next(iterator)[1])
        except ValueError as error:
            assert "cannot be rebuilt" in str(error)
            outcome.append("error")
    assert outcome == [0, "error", 2, 3]


def test_worker_init_exception():
    for cls in (DataLoader, FastLoader):
        with pytest.raises(ValueError, match="init failed in worker 0"):
            next(iter(cls(TensorDataset(), batch_size=2, num_workers=2,
                          worker_init_fn=failing_worker_init)))


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize(
    ("signum", "expected"),
    [(signal.SIGKILL, "killed by signal 9 \\(SIGKILL\\)"),
     (signal.SIGTERM, "killed by signal 15 \\(SIGTERM\\)"),
     (0, "exit code 3")],
)
def test_dead_worker_raises_quickly_and_cleans_up(persistent, signum, expected):
    # Within seconds of the death: beyond what starting two workers takes now, on this
    # machine under its present load (the start method's cost, a busy core), measured here,
    # and its workers gone before the leak count starts.
    start = time.monotonic()
    probe = iter(DataLoader(SuicideDataset(kill_at=-1), batch_size=2, num_workers=2))
    next(probe)
    startup = time.monotonic() - start
    del probe
    before = snapshot()
    loader = FastLoader(SuicideDataset(kill_at=6, signum=signum), batch_size=2, num_workers=2,
                        persistent_workers=persistent)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"DataLoader worker 1 \(pid \d+\) exited unexpectedly: "
                       + expected):
        list(loader)
    assert time.monotonic() - start < startup + 5
    del loader
    assert_no_leaks(before)


def test_timeout():
    for cls in (DataLoader, FastLoader):
        loader = cls(SlowDataset(delay=3), batch_size=1, num_workers=1, timeout=0.5)
        iterator = iter(loader)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0\.5 seconds"):
            try:
                next(iterator)
            finally:
                elapsed = time.monotonic() - start
        assert elapsed < 2.0
        del iterator


def test_timeout_with_no_workers_is_refused_like_torch():
    for cls in (DataLoader, FastLoader):
        with pytest.raises(AssertionError):
            iter(cls(TensorDataset(), timeout=1))


@pytest.mark.parametrize("how", ["break", "exception", "del"])
def test_abandoning_an_epoch_leaves_nothing(how):
    # Resources that live batches still hold are the user's; so each epoch runs in a function
    # whose locals (the loop variable) die with it.
    def epoch(loader):
        if how == "break":
            for i, _ in enumerate(loader):
                if i == 3:
                    break
        elif how == "exception":
            with pytest.raises(ZeroDivisionError):
                for i, _ in enumerate(loader):
                    if i == 3:
                        1 / 0  # noqa: B018
        else:
            iterator = iter(loader)
            next(iterator)
            del iterator

    before = snapshot()
    epoch(FastLoader(SlowDataset(delay=0.01), batch_size=4, num_workers=2))
    assert_no_leaks(before)


def test_persistent_workers_die_with_the_loader():
    before = snapshot()
    loader = FastLoader(TensorDataset(), batch_size=4, num_workers=2, persistent_workers=True)
    list(loader)
    assert len(loader_processes() - before[0]) == 2
    del loader
    assert_no_leaks(before)


def _script(body: str) -> list[str]:
    prelude = f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
    return [sys.executable, "-c", prelude + textwrap.dedent(body)]


def test_workers_exit_when_the_main_process_is_killed():
    shm_before = shm_entries()
    proc = subprocess.Popen(_script("""
        import os, signal
        from sample_datasets import SlowDataset
        from fastfeed import FastLoader
        loader = FastLoader(SlowDataset(delay=0.01), batch_size=64, num_workers=2)
        it = iter(loader)
        for _ in range(5):
            next(it)
        print(*[w.handle.pid for w in it._table], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """), stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL and len(pids) == 2
    assert wait_until(lambda: not any(alive(p) for p in pids), timeout=10), "workers outlived main"
    # Under spawn and forkserver, multiprocessing's semaphores are named until its resource
    # tracker unlinks them, once the last process that used it (a worker) has gone.
    assert wait_until(lambda: not new_shm(shm_before), timeout=10), new_shm(shm_before)


def test_ctrl_c_stops_cleanly():
    proc = subprocess.Popen(_script("""
        from sample_datasets import SlowDataset
        from fastfeed import FastLoader
        loader = FastLoader(SlowDataset(delay=0.2), batch_size=2, num_workers=2)
        it = iter(loader)
        print(*[w.handle.pid for w in it._table], flush=True)
        for batch in it:
            pass
    """), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert "KeyboardInterrupt" in err
    assert wait_until(lambda: not any(alive(p) for p in pids), timeout=10)


def test_many_abandoned_iterators_leak_nothing():
    before = snapshot()
    generator = torch.Generator().manual_seed(0)
    loader = FastLoader(TensorDataset(n=64), batch_size=4, num_workers=2)

    def partial_epoch(stop, loader=loader):
        for i, _ in enumerate(loader):
            if i == stop:
                break

    # Every batch of two epochs held at once: the loader's slot pool reaches its full size (the
    # first batches of the first epoch go out before it knows the batch size).
    list(loader) + list(loader)
    with_slot_pool = snapshot()
    for _ in range(30):
        partial_epoch(int(torch.randint(0, 17, (), generator=generator)))
    assert_no_leaks(with_slot_pool)
    # every slot back: none is held by a task that will never run
    assert wait_until(partial(slots_in_use_settle, loader._planner.slot_pool)), [
        (slot.state, slot.generation) for slot in loader._planner.slot_pool._slots.values()]
    del loader, partial_epoch  # the slot pool is the loader's: it goes with it
    assert_no_leaks(before)


def slots_in_use_settle(slot_pool) -> bool:
    gc.collect()
    return slot_pool.occupancy[0] == 0


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_a_break_gives_every_slot_back(worker_mode):
    """Tasks in flight when an epoch is abandoned hold tickets: they return to the loader's
    ring once the workers are gone, so the slot pool never fills up with slots nobody owns and
    later epochs keep the fast path. (Persistent workers answer them at the next epoch.)"""
    loader = FastLoader(TensorDataset(n=64), batch_size=4, num_workers=2, worker_mode=worker_mode)
    for _ in range(6):
        for i, _batch in enumerate(loader):
            if i == 1:
                break
        del _batch
        slot_pool = loader._planner.slot_pool
        assert wait_until(partial(slots_in_use_settle, slot_pool)), slot_pool.occupancy
    assert slot_pool.occupancy[1] <= slot_pool.max_slots


def test_ultralytics_patch_without_ultralytics_says_what_to_install():
    from fastfeed._imports import importable

    if importable("ultralytics"):
        pytest.skip("Ultralytics is installed here: the client tests cover patch()")
    import fastfeed.ultralytics as fu

    with pytest.raises(ImportError, match=re.escape(install_line("ultralytics"))):
        fu.patch()
    assert not fu.is_patched()


def test_an_iterator_collected_in_a_cycle_closes_only_its_own_pipes():
    """An abandoned iterator in a reference cycle is stopped by the cyclic collector. Its
    queues' pipes are closed once; no thread closes their fd numbers again later, when they
    may belong to another object (here, pipes made right after the collection)."""
    def feeders():
        return sum(t.name == "QueueFeederThread" for t in threading.enumerate())

    gc.collect()
    baseline = feeders()
    # One batch for two workers: the second worker's queue gets its first message (Stop) at
    # the collection.
    loader = FastLoader(TensorDataset(n=4), batch_size=4, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    iterator.cycle = iterator  # left to the cyclic collector, not to reference counting
    del iterator, loader
    gc.collect()
    pipes = [os.pipe() for _ in range(16)]  # they take the fd numbers freed
    try:
        wait_until(lambda: feeders() <= baseline, timeout=10)
        closed = []
        for fds in pipes:
            for fd in fds:
                try:
                    os.fstat(fd)
                except OSError:
                    closed.append(fd)
        assert closed == [], f"closed by another thread: {closed}"
    finally:
        for fds in pipes:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
