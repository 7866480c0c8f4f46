"""Device prefetch: a host iterator's batches, copied to the device some batches ahead."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from fastfeed._torch_compat import base_seed_of
from fastfeed.device.copiers import Copier
from fastfeed.iterators import HostBatch
from fastfeed.telemetry import Telemetry, batch_length

__all__ = ["AheadOfConsumer", "DeviceIterator", "HostIterator", "TorchIteratorHost"]


class HostIterator(Protocol):
    """What the device stage needs of the iterator it wraps (see
    :class:`fastfeed.iterators.base_iterator.BaseIterator`)."""

    base_seed: int

    def next_host_batch(self) -> HostBatch: ...

    def position(self) -> Any: ...

    def state_at(self, position: Any) -> Any: ...

    def close(self) -> None: ...

    def __len__(self) -> int: ...


class AheadOfConsumer:
    """What an iterator that readies its host's batches ahead of the consumer shares: a
    snapshot resumes after the last batch delivered, not the last one readied; the consumer's
    wait is measured here, the host iterator's own measure being off.

    Args:
        host: the iterator whose batches are readied.
        telemetry: the loader's.
        auto_collation: the loader batches samples itself (how samples are counted).
    """

    def __init__(self, host: HostIterator, telemetry: Telemetry, auto_collation: bool) -> None:
        self._host = host
        self._delivered_at = host.position()  # where the host stood after handing it over
        self._telemetry = telemetry
        self._auto_collation = auto_collation

    def _delivered(self, requested: float, batch: Any) -> None:
        """Record a batch handed to the consumer, asked for at ``requested``."""
        self._telemetry.delivered(requested, batch_length(batch, self._auto_collation))

    def __len__(self) -> int:
        return len(self._host)

    def state_dict(self) -> Any:
        """The host iterator's snapshot as of the last batch this iterator delivered."""
        return self._host.state_at(self._delivered_at)


class DeviceIterator(AheadOfConsumer):
    """Wraps a host iterator; yields batches already on the device, ``depth`` batches ahead.

    The host batch is dropped as soon as its copy is queued: the slot the copy reads is
    fenced with the copy's event through the batch's lease, and memory from torch's pinned
    pool is guarded by torch. So neither an abandoned iterator nor a slow consumer can let a
    slot be rewritten under a copy still queued.

    A ``transform`` whose ``blocks_host`` attribute is true (it waits for the GPU inside, as
    torchvision's JPEG decoder does) runs with its copy in a helper thread, so that the
    training thread goes on queueing its own work meanwhile; batches still come in order.
    Its ``prepare(device)``, if it has one (a kernel to compile), runs there first, as soon as
    the iterator is made: while the workers make the first batches, not in the first wait.
    """

    def __init__(
        self,
        host: HostIterator,
        copier: Copier,
        depth: int,
        transform: Callable[[Any], Any] | None,
        telemetry: Telemetry,
        auto_collation: bool = True,
    ) -> None:
        super().__init__(host, telemetry, auto_collation)
        self._copier = copier
        self._depth = depth
        self._transform = transform
        self._helper = (ThreadPoolExecutor(1, thread_name_prefix="fastfeed-copy")
                        if getattr(transform, "blocks_host", False) else None)
        # Raised, if it fails, with the first batch.
        self._prepared: Future | None = (
            self._helper.submit(copier.prepare, transform)
            if self._helper is not None and hasattr(transform, "prepare") else None)
        # ((device batch, event) or its Future, where the host stood after handing it over)
        self._ready: deque[tuple[Any, Any]] = deque()
        self._exhausted = False

    def __iter__(self) -> DeviceIterator:
        return self

    def close(self) -> None:
        """Drop the batches copied ahead, then close the host iterator (the fences keep the
        slots those copies read until they complete)."""
        self._ready.clear()
        self._exhausted = True
        if self._helper is not None:
            # A copy still running on the helper fences its slot only as it returns: closing
            # the slots before that would unmap memory a copy engine may still be reading.
            self._helper.shutdown(wait=True, cancel_futures=True)
        self._host.close()

    def _fill(self) -> None:
        while not self._exhausted and len(self._ready) < self._depth:
            try:
                host = self._host.next_host_batch()
                args = (host, self._transform, self._telemetry, self._copier.producer())
                copied: Any = (self._copier.copy(*args) if self._helper is None
                               else self._helper.submit(self._copier.copy, *args))
            except StopIteration:
                self._exhausted = True
                return
            except Exception as error:
                # Raised in its batch's turn, after the batches copied before it, as the stock
                # loader raises a worker's error; filling goes on at the next call. Without
                # this frame in its traceback: it holds the Future that holds the error.
                failed: Future = Future()
                failed.set_exception(error.with_traceback(
                    error.__traceback__.tb_next if error.__traceback__ else None))
                self._ready.append((failed, self._host.position()))
                return
            self._ready.append((copied, self._host.position()))

    def __next__(self) -> Any:
        requested = time.perf_counter()
        self._fill()
        if not self._ready:
            self._delivered_at = self._host.position()
            raise StopIteration
        copied, self._delivered_at = self._ready.popleft()
        if self._prepared is not None:
            prepared, self._prepared = self._prepared, None
            prepared.result()
        batch, event = copied.result() if isinstance(copied, Future) else copied
        if event is not None:
            self._copier.hand_over(batch, event)
        self._delivered(requested, batch)
        self._fill()  # queue the next copies now, so that they overlap the consumer's step
        return batch


class TorchIteratorHost:
    """torch's own iterators (DataPipes run on them) as a host: batches without leases, and
    no snapshots."""

    def __init__(self, iterator: Any) -> None:
        self._iterator = iterator
        self.base_seed = base_seed_of(iterator)

    def next_host_batch(self) -> HostBatch:
        return HostBatch(next(self._iterator), None)

    def position(self) -> None:
        return None

    def state_at(self, position: Any) -> Any:
        raise TypeError("DataPipe datasets run on torch's iterators and cannot be resumed")

    def close(self) -> None:
        pass

    def __len__(self) -> int:
        return len(self._iterator)
