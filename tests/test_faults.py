"""The fault-injection suite: bounded in time, and nothing left behind after each fault."""

import os
import random
import threading

import pytest
from helpers import assert_same
from procs import assert_no_leaks, loader_processes, rss_kb, snapshot
from sample_datasets import SlowDataset, TensorDataset
from torch.utils.data import DataLoader

from fastfeed import FastLoader


def failing_transform(batch):
    raise ArithmeticError("transform refuses")


def test_exception_in_gpu_transform_surfaces_and_leaks_nothing():
    before = snapshot()

    def epoch():
        loader = FastLoader(TensorDataset(), batch_size=4, num_workers=2, device="cpu",
                            gpu_transform=failing_transform)
        with pytest.raises(ArithmeticError, match="transform refuses"):
            next(iter(loader))

    epoch()
    assert_no_leaks(before)


def test_thousand_abandoned_iterators():
    # Iterators created and dropped at random points: no growth in processes, fds, threads
    # or /dev/shm entries.
    before = snapshot()
    threads = threading.active_count()
    rng = random.Random(0)
    loader = FastLoader(TensorDataset(n=32), batch_size=4, num_workers=2)

    def partial_epoch(stop, loader=loader):
        iterator = iter(loader)
        for _ in range(stop):
            next(iterator)

    # Every batch of two epochs held at once: the loader's slot pool reaches its full size (the
    # first batches of the first epoch go out before it knows the batch size).
    list(loader) + list(loader)
    with_slot_pool = snapshot()
    for _ in range(1000):
        partial_epoch(rng.randrange(0, 9))
    # Each abandoned iterator's workers are reaped after a grace: on a loaded machine (a
    # parallel run) the last of a thousand take longer than the usual 10 s to go.
    assert_no_leaks(with_slot_pool, timeout=60)
    assert threading.active_count() <= threads
    del loader, partial_epoch  # the slot pool is the loader's: it goes with it
    assert_no_leaks(before)


def test_rss_is_flat_over_thirty_persistent_epochs():
    loader = FastLoader(TensorDataset(n=256, shape=(3, 64, 64)), batch_size=16, num_workers=2,
                        persistent_workers=True, shuffle=True)
    readings = []
    for _ in range(30):
        for batch in loader:
            batch[0].float().mean()  # touch the data, as training would
        del batch
        readings.append(rss_kb() + sum(rss_kb(pid) for pid in loader_processes()))
    warm = readings[4]
    assert max(readings[5:]) <= warm * 1.10, readings


def test_sigint_while_workers_are_busy_in_process():
    # Ctrl-C arrives as KeyboardInterrupt in the main thread while workers sleep in __getitem__.
    before = snapshot()

    def epoch():
        loader = FastLoader(SlowDataset(delay=0.5), batch_size=1, num_workers=2)
        iterator = iter(loader)
        timer = threading.Timer(0.3, _interrupt_main)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            for _ in iterator:
                pass
        timer.join()

    epoch()
    assert_no_leaks(before)


def _interrupt_main():
    import _thread

    _thread.interrupt_main()


class DiesOnce(TensorDataset):
    """A worker reading index 5 exits (as the OOM killer would end it) while ``marker``
    exists; the marker goes with it, so the next epoch reads normally."""

    def __init__(self, marker):
        super().__init__()
        self.marker = marker

    def __getitem__(self, index):
        if index == 5 and os.path.exists(self.marker):
            os.unlink(self.marker)
            os._exit(3)
        return super().__getitem__(index)


def test_a_dead_persistent_worker_is_replaced_for_the_next_epoch(tmp_path):
    marker = tmp_path / "die"
    marker.touch()
    loader = FastLoader(DiesOnce(str(marker)), batch_size=4, num_workers=2,
                        persistent_workers=True)
    with pytest.raises(RuntimeError, match=r"worker \d \(pid \d+\) exited unexpectedly"):
        list(loader)
    with pytest.warns(RuntimeWarning, match="starting new workers"):
        got = list(loader)
    expected = list(DataLoader(DiesOnce(str(marker)), batch_size=4, num_workers=2))
    assert_same(expected, got)
    assert_same(expected, list(loader))  # and the new workers persist
    del loader
