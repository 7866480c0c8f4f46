"""``pin_memory=True`` without ``device=``: batches copied into torch's pinned memory, ahead of
the consumer, where torch's pin-memory thread copies them.

With workers, a helper thread takes each batch as the host iterator hands it over (the host
iterator runs on that thread: dispatch, answers, the batch rebuilt in its slot), copies it
into pinned memory, and queues it; ``next()`` on the training thread takes the oldest ready
batch. With ``num_workers=0`` the batch is pinned in ``next()``, as torch's single-process
iterator pins it.

* At most ``ahead`` pinned batches wait. torch counts the batches its pin thread holds among
  the ``prefetch_factor * num_workers`` tasks in flight; the pool here keeps its tasks in flight
  whatever the helper holds, so the helper pins only a couple ahead (a copy takes
  milliseconds): what is read ahead is stock's, plus those.
* The helper thread is set up as torch's pin thread is: one intra-op thread (the copies must
  not take every core from the workers and the training thread) and the training GPU as its
  current device (pinned memory is allocated in that GPU's context: a rank must not create a
  context on GPU 0). Not, as torch's, the training thread's current device: a script that
  moved its model to ``cuda:N`` without ``set_device`` has device 0 current and no context
  there (:func:`~fastfeed.device.resolve.training_device`).
* The host batch, and with it the lease on its slot, is dropped once its copy is made: no slot
  returns to the pool while a copy of it runs (docs/design.md, invariant 2), and none is held
  by a batch that waits pinned. (``pin_memory`` leaves numpy arrays as they are: those keep their
  slot, as in any host batch.)
* An error of the host iterator is raised in its batch's turn; the helper then pulls nothing
  more until the consumer has taken it.
* ``state_dict()`` is the host's snapshot as of the last batch delivered, not the last pinned.
* The helper holds no reference to this iterator. A dropped iterator (a ``break``, a ``del``,
  the end of the script), :meth:`PinnedIterator.close` and the device stage (before persistent
  workers' next epoch) make it leave at once, by interrupting the host iterator's wait for its
  workers, and join it, as torch joins its pin thread when its iterator goes: the host iterator
  is closed only once the helper has left, and the interpreter never finalizes with the helper
  inside a copy (a daemon thread still in C++ code then is ended by ``pthread_exit``, whose
  unwinding through torch's frames aborts the process: ``terminate called without an active
  exception``).
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from fastfeed._torch_compat import pin_memory
from fastfeed.device.prefetch import AheadOfConsumer
from fastfeed.device.resolve import training_device
from fastfeed.iterators import BaseIterator
from fastfeed.telemetry import Telemetry

__all__ = ["PinHelper", "PinnedIterator", "pin_batch"]

# How long close() waits for the helper to leave (it leaves once the host iterator is closed).
_JOIN_S = 5.0


def pin_batch(batch: Any) -> Any:
    """``batch`` with every tensor copied into torch's pinned memory (only called when CUDA is
    available; the tests replace it with a stand-in)."""
    return pin_memory(batch)


@dataclass(frozen=True)
class _Pinned:
    batch: Any
    position: Any  # the host's, after handing it over


@dataclass(frozen=True)
class _Raised:
    error: BaseException
    position: Any


@dataclass(frozen=True)
class _Ended:
    position: Any


_Item = _Pinned | _Raised | _Ended


class _Queue:
    """The pinned batches (and errors, and the end) the helper hands the consumer, in order."""

    def __init__(self, ahead: int) -> None:
        self.ahead = ahead
        self.changed = threading.Condition()
        self.items: collections.deque[_Item] = collections.deque()
        self.paused = False  # an error waits for the consumer: pull nothing more
        self.stopped = False  # the consumer's side wants nothing more: leave, keep nothing
        self.finished = False  # the helper has left: no item will come

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
            self.items.clear()
            self.changed.notify_all()


def _pin_ahead(host: BaseIterator, queue: _Queue, cuda_index: int | None) -> None:
    """The helper's loop: pull, pin, queue, until the epoch ends or the queue is stopped."""
    torch.set_num_threads(1)  # this thread's count alone, as torch's pin thread sets it
    if cuda_index is not None:
        torch.cuda.set_device(cuda_index)
    try:
        while True:
            with queue.changed:
                while not queue.stopped and (queue.paused or len(queue.items) >= queue.ahead):
                    queue.changed.wait()
                if queue.stopped:
                    return
            item = _pull(host)
            with queue.changed:
                if queue.stopped:
                    return
                queue.items.append(item)
                queue.paused = isinstance(item, _Raised)
                queue.changed.notify_all()
            if isinstance(item, _Ended):
                return
            del item
    finally:
        with queue.changed:
            queue.finished = True
            queue.changed.notify_all()


class PinHelper:
    """The helper thread of one :class:`PinnedIterator`, and the queue it fills.

    It holds the host iterator only while it runs; it holds no reference to the pinned
    iterator, whose loss (a ``break``) stops it.
    """

    def __init__(self, host: BaseIterator, ahead: int) -> None:
        self.queue = _Queue(ahead)
        self._host = weakref.ref(host)  # to interrupt its waits; the thread holds it
        # The training GPU, where CUDA is in use (asking would initialise it).
        cuda_index = training_device().index if torch.cuda.is_initialized() else None
        self._thread = threading.Thread(target=_pin_ahead, args=(host, self.queue, cuda_index),
                                        name="fastfeed-pin", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Drop what is queued; the helper leaves after the batch it is pulling, if any."""
        self.queue.stop()

    def leave(self, timeout: float | None = None) -> None:
        """Stop the helper, interrupt its wait for the host iterator's workers, and wait until
        it has left the host iterator (up to ``timeout`` seconds)."""
        self.stop()
        if threading.current_thread() is self._thread:
            return  # collected on the helper itself (a cycle): it returns from this pull
        host = self._host()
        if host is None:  # the helper has left already: only it held the host
            self._thread.join(timeout)
            return
        with host.waits_interrupted():
            self._thread.join(timeout)


def _pull(host: BaseIterator) -> _Item:
    try:
        host_batch = host.next_host_batch()
        # The copy reads the slot while host_batch holds it; then the lease goes with it.
        pinned = pin_batch(host_batch.batch)
    except StopIteration:
        return _Ended(host.position())
    except BaseException as error:
        # Raised in the consumer's thread without the helper's frames, which hold the host
        # iterator: an error kept by the user must not keep its workers alive.
        return _Raised(error.with_traceback(None), host.position())
    del host_batch
    return _Pinned(pinned, host.position())


class PinnedIterator(AheadOfConsumer):
    """Wraps a host iterator; yields its batches in torch's pinned memory.

    Args:
        host: the iterator whose batches are pinned.
        ahead: batches pinned ahead of the consumer, on a helper thread; 0 pins each batch in
            ``next()``.
        telemetry: the loader's; this iterator measures the consumer's wait.
        auto_collation: the loader batches samples itself (how samples are counted).
    """

    def __init__(self, host: BaseIterator, ahead: int, telemetry: Telemetry,
                 auto_collation: bool = True) -> None:
        super().__init__(host, telemetry, auto_collation)
        self._ended = False
        self.helper: PinHelper | None = None
        if ahead:
            self.helper = PinHelper(host, ahead)
            # Dropped without close(), or alive at exit: the helper leaves, joined.
            weakref.finalize(self, self.helper.leave, _JOIN_S)

    def __iter__(self) -> PinnedIterator:
        return self

    def __next__(self) -> Any:
        requested = time.perf_counter()
        if self.helper is None:  # num_workers=0: pinned here, as torch pins it
            try:
                batch = pin_batch(self._host.next_host_batch().batch)
            finally:
                self._delivered_at = self._host.position()
        else:
            item = self._next_item()
            self._delivered_at = item.position
            if isinstance(item, _Ended):
                self._ended = True
                raise StopIteration
            if isinstance(item, _Raised):
                raise item.error
            batch = item.batch
        self._delivered(requested, batch)
        return batch

    def _next_item(self) -> _Item:
        assert self.helper is not None
        if self._ended:
            return _Ended(self._delivered_at)
        queue = self.helper.queue
        with queue.changed:
            while not queue.items and not queue.finished and not queue.stopped:
                queue.changed.wait()
            if not queue.items:  # stopped: closed, or a new epoch took the host iterator
                return _Ended(self._delivered_at)
            item = queue.items.popleft()
            queue.paused = False
            queue.changed.notify_all()
        return item

    def close(self) -> None:
        """Stop the helper, then the host iterator's workers; no thread is left behind."""
        if self.helper is not None:
            self.helper.leave(_JOIN_S)
        self._host.close()

    # What frameworks reach for on torch's iterator (Ultralytics' InfiniteDataLoader.close()).
    @property
    def _workers(self) -> list[Any]:
        return list(getattr(self._host, "_workers", []))

    def _shutdown_workers(self) -> None:
        self.close()
