"""What every FastLoader iterator shares with torch's ``_BaseDataLoaderIter``, and the contract
the device stage reads a host iterator through.

The order of RNG draws matters for reproducibility: the base seed is drawn from
``loader.generator`` when the iterator is created, and the sampler draws on its first
``next``, exactly as in torch, so ``shuffle=True`` with the same seed gives the same order.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader

from fastfeed._torch_compat import index_sampler, is_iterable_dataset, iterable_len_called
from fastfeed.iterators.host_plan import HostPlan
from fastfeed.protocol import WorkerConfig
from fastfeed.resume import EpochStart, LoaderState, RandomSources
from fastfeed.slots import Lease
from fastfeed.telemetry import batch_length

__all__ = ["BaseIterator", "HostBatch", "Position"]


class HostBatch(NamedTuple):
    """A batch as a host iterator hands it over, with the lease on the slot it lives in
    (None when it lives in no pool slot)."""

    batch: Any
    lease: Lease | None


@dataclass(frozen=True)
class Position:
    """Where an epoch stands after the batches handed out so far: enough to build a snapshot
    later (:meth:`BaseIterator.state_at`), cheap enough to note after every batch."""

    batches_yielded: int
    epoch_start: EpochStart
    dataset_states: tuple[Any, ...]
    next_worker: int = 0
    workers_done: tuple[bool, ...] | None = None
    exhausted: bool = False
    out_of_order: bool = False  # batches were handed out out of sampler order


class BaseIterator:
    """Sampler iteration, seeding, snapshots and the IterableDataset length check.

    The device stage reads a host iterator only through :meth:`next_host_batch`,
    :meth:`position`, :meth:`state_at`, :attr:`base_seed`, ``len()`` and :meth:`close`.
    """

    def __init__(self, loader: DataLoader, plan: HostPlan) -> None:
        self._plan = plan
        # What the workers read and collate with, under the names torch's iterators give them
        # (code that reaches into the iterator finds them there).
        self._dataset: Any = plan.dataset
        self._collate_fn = plan.collate_fn
        self._iterable = is_iterable_dataset(loader.dataset)
        self._len_called = iterable_len_called(loader)
        self._auto_collation = loader.batch_sampler is not None
        self._drop_last = loader.drop_last
        self._index_sampler = index_sampler(loader)
        self._num_workers = loader.num_workers
        self._timeout = loader.timeout
        self._worker_init_fn = loader.worker_init_fn
        self._persistent_workers = loader.persistent_workers
        self._telemetry = plan.telemetry

        if loader.pin_memory and loader.pin_memory_device:
            warnings.warn(
                "pin_memory_device is deprecated, the current accelerator will be used as the "
                f"device,ignore pin_memory_device='{loader.pin_memory_device}'.",
                stacklevel=3,
            )
        if loader.pin_memory and not torch.accelerator.is_available():
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=3,
            )

        self._random = RandomSources.of(loader)
        resume = plan.carry_over.take_resume()
        if resume is not None:
            resume.epoch_start.restore(self._random)
        self._epoch_start = EpochStart.capture(self._random)
        self._sampler_iter = iter(self._index_sampler)
        # Replay the epoch's draws exactly: a snapshot of a persistent iterator's later epoch
        # drew no base seed, and carries the one its workers had.
        self._draws_base_seed = resume is None or resume.draws_base_seed
        if self._draws_base_seed:
            self.base_seed = int(
                torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item()
            )
        else:
            assert resume is not None and resume.base_seed is not None
            self.base_seed = resume.base_seed
        self._num_yielded = 0
        self._skip_by_reading = 0
        self._exhausted = False
        self._resume = resume  # applied when the first epoch starts
        # IterableDataset.state_dict() after the last delivered batch, per replica.
        self._dataset_states: list[Any] = [None] * max(1, self._num_workers)

    def __iter__(self) -> BaseIterator:
        return self

    def _worker_config(self, worker_id: int, *, num_workers: int | None = None,
                       dataset_state: Any = None) -> WorkerConfig:
        """What worker ``worker_id`` (or the main process, with ``num_workers=0``) needs to
        produce this iterator's batches."""
        return WorkerConfig(
            dataset=self._plan.dataset,
            iterable=self._iterable,
            auto_collation=self._auto_collation,
            collate_fn=self._plan.collate_fn,
            drop_last=self._drop_last,
            base_seed=self.base_seed,
            worker_init_fn=self._worker_init_fn if self._num_workers else None,
            worker_id=worker_id,
            num_workers=self._num_workers if num_workers is None else num_workers,
            dataset_state=dataset_state,
            deterministic=self._plan.deterministic,
        )

    def _replica_state(self, resume: LoaderState | None, worker_id: int) -> Any:
        """The IterableDataset state worker ``worker_id`` resumes from, if any."""
        return None if resume is None else resume.replica_state(worker_id, self._num_workers)

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        """Start an epoch with a new pass of the sampler, as torch's ``_reset`` does."""
        self._sampler_iter = iter(self._index_sampler)
        self._start_epoch(loader, first_iter)

    def _start_epoch(self, loader: DataLoader, first_iter: bool) -> None:
        # A snapshot applies only to a new iterator (load_state_dict drops a persistent one).
        resume, self._resume = self._resume, None
        if not first_iter:
            self._epoch_start = EpochStart.capture(self._random)
            self._draws_base_seed = False  # persistent workers keep theirs
        self._num_yielded = 0
        self._skip_by_reading = 0
        self._exhausted = False
        self._len_called = iterable_len_called(loader)
        self._epoch_resume = resume
        if resume is not None:
            self._fast_forward(resume)

    def _fast_forward(self, resume: LoaderState) -> None:
        """Skip the batches a snapshot says were already delivered."""
        if not self._iterable:
            for skipped in range(resume.batches_yielded):
                try:
                    next(self._sampler_iter)  # indices only: nothing is loaded
                except StopIteration:
                    raise ValueError(
                        f"the loader state says {resume.batches_yielded} batches were "
                        f"delivered, but this epoch has only {skipped}"
                    ) from None
            self._num_yielded = resume.batches_yielded
        elif resume.dataset_states is not None:
            self._dataset_states = list(resume.dataset_states)
            self._num_yielded = resume.batches_yielded
        else:
            self._skip_by_reading = resume.batches_yielded  # no dataset state: re-read

    # -- snapshots ---------------------------------------------------------------------------
    def position(self) -> Position:
        """Where the epoch stands after the batches handed out so far."""
        return Position(self._num_yielded, self._epoch_start, tuple(self._dataset_states),
                        exhausted=self._exhausted, **self._round_robin_position())

    def state_at(self, position: Position) -> LoaderState:
        """A snapshot from which a new loader resumes right after ``position``.

        Raises:
            RuntimeError: batches before ``position`` were handed out of sampler order.
        """
        if position.exhausted:  # the next epoch: persistent workers will draw no base seed
            persistent = self._persistent_workers and self._num_workers > 0
            return LoaderState(epoch_start=EpochStart.capture(self._random),
                               draws_base_seed=not persistent,
                               base_seed=self.base_seed if persistent else None)
        if position.out_of_order:
            # Out of order, the delivered batches are not the first N of the sampler: a count
            # cannot say which they were.
            raise RuntimeError("a mid-epoch state_dict() needs in_order=True (with "
                               "in_order=False, batches arrive out of sampler order)")
        states = position.dataset_states
        return LoaderState(
            batches_yielded=position.batches_yielded,
            epoch_start=position.epoch_start,
            dataset_states=list(states) if any(s is not None for s in states) else None,
            draws_base_seed=self._draws_base_seed,
            base_seed=self.base_seed,
            next_worker=position.next_worker,
            workers_done=None if position.workers_done is None else list(position.workers_done),
        )

    def state_dict(self) -> LoaderState:
        """A snapshot from which a new loader resumes at the next batch of this epoch."""
        return self.state_at(self.position())

    def _round_robin_position(self) -> dict[str, Any]:
        return {}

    # -- batches -----------------------------------------------------------------------------
    def _next_index(self) -> Any:
        return next(self._sampler_iter)  # StopIteration ends the epoch

    def _next_data(self) -> HostBatch:
        raise NotImplementedError

    def _after_delivery(self) -> None:
        """Called after each batch is handed over (the worker pool tunes itself here)."""

    def next_host_batch(self) -> HostBatch:
        """The next batch, with the lease on its slot."""
        requested = time.perf_counter()
        try:
            while self._skip_by_reading:
                self._next_data()
                self._skip_by_reading -= 1
                self._num_yielded += 1
            data = self._next_data()
        except StopIteration:
            self._exhausted = True
            raise
        self._num_yielded += 1
        if not self._plan.times_delivery:
            self._telemetry.delivered(requested, batch_length(data.batch, self._auto_collation))
        self._after_delivery()
        if self._iterable and self._len_called is not None and self._num_yielded > self._len_called:
            message = (
                f"Length of IterableDataset {self._plan.dataset} was reported to be "
                f"{self._len_called}(when accessing len(dataloader)), but {self._num_yielded} "
                "samples have been fetched. "
            )
            if self._num_workers > 0:
                message += (
                    "For multiprocessing data-loading, this could be caused by not properly "
                    "configuring the IterableDataset replica at each worker. Please see "
                    "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                    "for examples."
                )
            warnings.warn(message, stacklevel=3)
        return data

    def __next__(self) -> Any:
        return self.next_host_batch().batch

    def __len__(self) -> int:
        return len(self._index_sampler)

    @contextlib.contextmanager
    def waits_interrupted(self) -> Iterator[None]:
        """Meanwhile, a wait of this iterator's for its workers, in whatever thread, raises
        :class:`~fastfeed.iterators.liveness.WaitInterrupted` (nothing is received, so the
        iterator's state is as before the wait): how the device stage gets its helper thread
        out of the host iterator before closing it or starting its next epoch."""
        yield

    def close(self) -> None:
        """Stop the workers now, not when the iterator is collected."""

    def __getstate__(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot be pickled")
