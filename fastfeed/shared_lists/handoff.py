"""How a pool's workers get the dataset's lists as shared copies.

The main process takes one :class:`ListsSnapshot` when the pool's workers start (as a fork gives
them the dataset as it is then): it packs the lists :func:`find_lists` finds into one sealed
mapping. Each worker is then started with a :class:`ListsHandOff` in place of its config:

- **fork**: the worker inherits the hand-off, the dataset and the mapping. Before anything else
  (seeding, ``worker_init_fn``), :func:`received_config` points each attribute that held a
  packed list at its :class:`SharedList`. The dataset objects stay the ones the worker
  inherited (``get_worker_info().dataset`` is the object the user's module-level names see), and
  the original lists stay referenced from this module: were the last reference dropped, the
  worker would decrement every element, writing (so copying) every page of the list.
- **spawn, forkserver**: the hand-off is pickled, and unpickled in the worker as the config
  itself. The config is pickled as multiprocessing would pickle it, but with each packed list
  replaced by a reference to its shared copy, and the mapping's descriptor travels beside it
  (multiprocessing's ``DupFd``): the lists are never pickled.

In the main process the user's objects are never changed.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import time
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import IO, Any

from fastfeed.protocol import WorkerConfig
from fastfeed.shared_lists.columns import SequenceLayout, encode_sequence
from fastfeed.shared_lists.finder import Found, find_lists
from fastfeed.shared_lists.packing import PackedLists
from fastfeed.shared_lists.shared_list import SharedList

__all__ = ["ListsHandOff", "ListsSnapshot", "received_config"]

logger = logging.getLogger(__name__)

# In a forked worker: the original lists, referenced for as long as the worker lives.
_originals: list[list | tuple] = []


class ListsSnapshot:
    """The dataset's large lists of plain values, packed when a pool's workers start.

    Args:
        found: the lists that were packed, and the attributes that held them.
        packed: their shared copies (None: nothing to share).
    """

    def __init__(self, found: list[Found], packed: PackedLists | None) -> None:
        self.found = found
        self.packed = packed
        self._tokens = {id(item.sequence): token for token, item in enumerate(found)}

    @classmethod
    def take(cls, dataset: Any, keep_fd: bool, candidates: list[Found] | None = None
             ) -> ListsSnapshot:
        """Pack the lists of ``dataset`` worth sharing; ``keep_fd``: workers started by
        pickling (spawn, forkserver) will need the mapping's descriptor. ``candidates``: what
        :func:`~.finder.find_lists` found in it, where the caller has looked already."""
        started = time.perf_counter()
        found, encoded = [], []
        for item in find_lists(dataset) if candidates is None else candidates:
            sequence = encode_sequence(item.sequence)
            if sequence is not None:  # it holds something other than plain values
                found.append(item)
                encoded.append(sequence)
        if not found:
            return cls([], None)
        packed = PackedLists.pack(encoded)
        if not keep_fd:  # forked workers inherit the mapping itself
            packed.close_fd()
        logger.debug("shared %d lists (%s elements, %.1f MB) in %.3f s",
                     len(found), ", ".join(str(len(item.sequence)) for item in found),
                     packed.nbytes / 1e6, time.perf_counter() - started)
        return cls(found, packed)

    def hand_off(self, config: WorkerConfig) -> WorkerConfig | ListsHandOff:
        """What to start a worker with in place of ``config``."""
        return config if self.packed is None else ListsHandOff(config, self)

    def token(self, obj: Any) -> int | None:
        """The packed list ``obj`` is, by its position (None: it is no packed list)."""
        return self._tokens.get(id(obj)) if type(obj) in (list, tuple) else None

    def close(self) -> None:
        """No worker will start from this snapshot any more."""
        if self.packed is not None:
            self.packed.close_fd()


class ListsHandOff:
    """A worker's config and the snapshot it reads the dataset's lists from."""

    def __init__(self, config: WorkerConfig, snapshot: ListsSnapshot) -> None:
        self.config = config
        self.snapshot = snapshot

    def __reduce__(self) -> tuple[Any, ...]:
        # Only while multiprocessing starts a worker: DupFd hands the descriptor to that worker.
        packed = self.snapshot.packed
        assert packed is not None and packed.fd is not None
        payload = io.BytesIO()
        _ListsPickler(payload, self.snapshot).dump(self.config)
        return _unpickled_config, (payload.getvalue(), DupFd(packed.fd), packed.nbytes,
                                   packed.layouts)

    def swap_in(self) -> WorkerConfig:
        """In a forked worker: point the attributes that held packed lists at their shared
        copies; return the config."""
        packed = self.snapshot.packed
        assert packed is not None
        packed.close_fd()  # this process's inherited copy: it has the mapping
        for item, shared in zip(self.snapshot.found, packed.lists, strict=True):
            for owner, name in item.owners:
                # Set since the snapshot (a worker started later by the tuner): keep the new one.
                if owner.__dict__.get(name) is item.sequence:
                    owner.__dict__[name] = shared
            _originals.append(item.sequence)
        return self.config


def received_config(config: WorkerConfig | ListsHandOff) -> WorkerConfig:
    """The config a worker was started with, its dataset reading the shared lists."""
    return config.swap_in() if isinstance(config, ListsHandOff) else config


class _ListsPickler(ForkingPickler):
    """multiprocessing's pickler, with each packed list pickled as a reference to its copy."""

    def __init__(self, file: IO[bytes], snapshot: ListsSnapshot) -> None:
        super().__init__(file)
        self._snapshot = snapshot

    def persistent_id(self, obj: Any) -> int | None:
        return self._snapshot.token(obj)


class _ListsUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], lists: list[SharedList]) -> None:
        super().__init__(file)
        self._lists = lists

    def persistent_load(self, pid: Any) -> SharedList:
        return self._lists[pid]


def _unpickled_config(payload: bytes, fd: Any, nbytes: int,
                      layouts: tuple[SequenceLayout, ...]) -> WorkerConfig:
    """In a spawned worker: map the shared copies, then unpickle the config over them."""
    descriptor = fd.detach()
    try:
        packed = PackedLists.attach(descriptor, nbytes, layouts)
    finally:
        os.close(descriptor)
    return _ListsUnpickler(io.BytesIO(payload), packed.lists).load()
