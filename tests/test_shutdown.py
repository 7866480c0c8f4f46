"""Shutdown never blocks the training thread, and iterators die by reference counting.

The garbage collector runs finalisers in whatever thread allocates at that moment, in the
middle of the user's code: a finaliser that joined workers would stall training there.
"""

import gc
import os
import signal
import sys
import threading
from multiprocessing.process import BaseProcess

import pytest
from procs import alive, assert_no_leaks, snapshot, wait_until
from sample_datasets import BusyAfterFirst, FailingDataset, SlowDataset, TensorDataset

from fastfeed import FastLoader


def workers_of(iterator):
    return [worker.handle.pid for worker in iterator._table]


def gone(pids):
    return not any(alive(pid) for pid in pids)


def consume(loader, how):
    iterator = iter(loader)
    if how == "error":
        with pytest.raises(KeyError):
            for _ in range(len(loader)):
                next(iterator)
    else:
        next(iterator)
    return iterator


@pytest.mark.parametrize("how", ["partial", "error", "device", "persistent"])
def test_workers_exit_when_the_last_reference_goes_without_the_collector(how):
    kwargs = {"batch_size": 2, "num_workers": 2}
    dataset = FailingDataset(bad=5, n=40) if how == "error" else TensorDataset(n=40)
    if how == "device":
        kwargs["device"] = "cpu"
    if how == "persistent":
        kwargs["persistent_workers"] = True
    gc.collect()
    gc.disable()
    try:
        loader = FastLoader(dataset, **kwargs)
        iterator = consume(loader, how)
        host = getattr(iterator, "_host", iterator)
        pids = workers_of(host)
        assert pids and not gone(pids)
        del iterator, host
        if how == "persistent":  # the loader holds its iterator for the next epoch
            assert not gone(pids)
            del loader
        assert wait_until(lambda: gone(pids), timeout=10)
    finally:
        gc.enable()


@pytest.fixture
def waits(monkeypatch):
    """Every ``join``, ``terminate`` and ``kill`` of a worker process from now on, as ``(what,
    pid, thread)``: a wait is recorded, not timed (a loaded machine slows code that waits for
    nothing, and a parallel run loads it)."""
    made = []

    def recording(name):
        method = getattr(BaseProcess, name)

        def recorded(self, *args, **kwargs):
            made.append((name, self.pid, threading.current_thread().name))
            return method(self, *args, **kwargs)
        return recorded

    for name in ("join", "terminate", "kill"):
        monkeypatch.setattr(BaseProcess, name, recording(name))
    return made


def waited_here(waits, pids):
    """What this (the training) thread waited for among the processes ``pids``."""
    here = threading.current_thread().name
    return [what for what, pid, thread in waits if pid in pids and thread == here]


def test_a_finaliser_never_blocks_and_busy_workers_are_terminated(waits):
    loader = FastLoader(BusyAfterFirst(delay=30), batch_size=1, num_workers=2)
    iterator = iter(loader)
    next(iterator)  # both workers are now sleeping in __getitem__
    pids = workers_of(iterator)
    iterator._cycle = iterator  # only the garbage collector can free it now
    del iterator
    gc.collect()  # runs the finaliser here, as an allocation in user code would
    assert waited_here(waits, pids) == [], "the finaliser waited on workers in this thread"
    assert wait_until(lambda: gone(pids), timeout=10), "busy workers were not terminated"
    assert {"join", "terminate"} <= {what for what, pid, _ in waits if pid in pids}


def test_a_forked_child_leaves_the_parents_workers_alone():
    loader = FastLoader(TensorDataset(n=40), batch_size=2, num_workers=2,
                        persistent_workers=True)
    iterator = iter(loader)
    next(iterator)
    pids = workers_of(iterator)
    # Earlier tests' garbage is collected here, not in the child: torch's own iterator fails
    # its finaliser in a forked child ("can only test a child process"), and a stock iterator
    # left in a cycle by a test that ran before this one (in a random order) failed this test.
    gc.collect()
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: drop everything inherited, and report any finaliser error
        errors = []
        sys.unraisablehook = errors.append
        try:
            del iterator, loader
            gc.collect()
        finally:
            report = "".join(f"{e.exc_type.__name__}: {e.exc_value} ({e.err_msg} {e.object!r})\n"
                             for e in errors)
            os.write(write_end, report.encode()[:60_000])
            os._exit(min(len(errors), 100))
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        report = pipe.read()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"finalisers failed in the child:\n{report}"
    assert not gone(pids)
    assert len(list(iterator)) == 19  # the parent's workers still serve it


def _abandon(iterator, workers):
    workers += workers_of(iterator)
    iterator._cycle = iterator  # as an exception's traceback would, before the fix


def test_timeout_arrives_on_time_after_many_varied_loaders(waits):
    """The reported sequence: varied loaders left to the collector, then a ``timeout`` loader
    whose error must not wait for their shutdowns."""
    workers = []
    for kwargs in [{"persistent_workers": True}, {"multiprocessing_context": "spawn"},
                   {"multiprocessing_context": "forkserver"}, {}, {"in_order": False}]:
        loader = FastLoader(BusyAfterFirst(delay=30), batch_size=1, num_workers=1, **kwargs)
        iterator = iter(loader)
        next(iterator)
        _abandon(iterator, workers)
    for _ in range(3):
        loader = FastLoader(FailingDataset(bad=0), batch_size=1, num_workers=2)
        iterator = iter(loader)
        with pytest.raises(KeyError):
            next(iterator)
        _abandon(iterator, workers)
    del loader, iterator
    gc.collect()  # the stalled sequence ran these finalisers inside the next loader's __init__
    slow = FastLoader(SlowDataset(delay=5), batch_size=1, num_workers=1, timeout=0.5)
    with pytest.raises(RuntimeError, match=r"timed out after 0\.5 seconds"):
        next(iter(slow))
    # Their shutdowns waited elsewhere: this thread never waited on one of them.
    assert waited_here(waits, workers) == []
    assert wait_until(lambda: gone(workers), timeout=15)


class FakeWorker:
    """A worker process as the backend sees it: ``stops`` says whether terminate() works,
    ``dies`` whether kill() does (a process in uninterruptible sleep outlives it too);
    ``reaped_elsewhere`` stands for a child another waitpid collected (its pid is gone, its
    exit code never known)."""

    def __init__(self, stops: bool = True, dies: bool = True, reaped_elsewhere: bool = False):
        self.exitcode = None
        self.stops, self.dies = stops, dies
        self.pid = _unused_pid() if reaped_elsewhere else os.getpid()

    def join(self, timeout=None):
        pass

    def terminate(self):
        if self.stops:
            self.exitcode = -15

    def kill(self):
        if self.dies:
            self.exitcode = -9


def _unused_pid() -> int:
    pid = 2**22 - 1  # above the usual pid_max's default
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


@pytest.mark.parametrize(("workers", "released"), [
    ([FakeWorker(), FakeWorker()], True),
    ([FakeWorker(), FakeWorker(reaped_elsewhere=True)], True),
    ([FakeWorker(), FakeWorker(stops=False)], True),
    ([FakeWorker(), FakeWorker(stops=False, dies=False)], False),
], ids=["stopped", "reaped-elsewhere", "killed", "one-still-running"])
def test_tickets_return_only_once_no_worker_can_write(workers, released):
    """docs/design.md, invariant 2 on shutdown: the slots of tasks still in flight go back to the
    pool only when every worker is gone; one that outlives terminate() is killed, and a worker
    that outlives that too keeps them."""
    from fastfeed.backends.process_reaper import stop_processes

    calls = []
    stop_processes(workers, 0.0, lambda: calls.append("released"))
    for thread in threading.enumerate():  # a killed worker is joined on a reaper thread
        if thread.name == "fastfeed-reaper":
            thread.join()
    assert calls == (["released"] if released else [])


def ignore_sigterm(worker_id):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def test_a_worker_that_ignores_terminate_is_killed_and_joined():
    """A worker busy in a ``__getitem__`` that ignores SIGTERM (a dataset library's own
    handler, say) is killed after the grace, and joined: no process, and no descriptor of
    multiprocessing's handle on it, is left behind."""
    before = snapshot()
    loader = FastLoader(SlowDataset(delay=30), batch_size=1, num_workers=1, timeout=0.5,
                        worker_init_fn=ignore_sigterm)
    with pytest.raises(RuntimeError, match="timed out"):
        next(iter(loader))
    del loader
    assert_no_leaks(before)


def close_as_ultralytics_does(iterator):
    """Ultralytics' InfiniteDataLoader.close(): terminate the live worker processes that
    torch's iterator lists, then shut the iterator's workers down."""
    if hasattr(iterator, "_workers"):
        for worker in iterator._workers:
            if worker.is_alive():
                worker.terminate()
        iterator._shutdown_workers()


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_framework_closes_the_iterator_through_torchs_attributes(mode):
    from torch.utils.data import DataLoader

    for cls, kwargs in ((DataLoader, {}), (FastLoader, {"worker_mode": mode})):
        loader = cls(SlowDataset(n=64), batch_size=2, num_workers=2, persistent_workers=True,
                     **kwargs)
        iterator = iter(loader)
        next(iterator)
        pids = [w.pid for w in iterator._workers]
        assert len(pids) == (0 if mode == "thread" and cls is FastLoader else 2)
        close_as_ultralytics_does(iterator)  # torch's own and ours: neither raises
        assert wait_until(lambda pids=pids: gone(pids), 5)
