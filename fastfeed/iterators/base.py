"""What every FastLoader iterator shares with torch's ``_BaseDataLoaderIter``.

The order of RNG draws matters for reproducibility: the base seed is drawn from
``loader.generator`` when the iterator is created, and the sampler draws on its first
``next``, exactly as in torch, so ``shuffle=True`` with the same seed gives the same order.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader

from fastfeed._torch_compat import is_iterable_dataset, pin_memory
from fastfeed.iterators.setup import IteratorSetup
from fastfeed.resume import EpochStart, LoaderState, RandomSources
from fastfeed.ring import SlotRing
from fastfeed.telemetry import batch_length

__all__ = ["BaseIterator"]


class BaseIterator:
    """Sampler iteration, seeding, pinning and the IterableDataset length check."""

    def __init__(self, loader: DataLoader, setup: IteratorSetup) -> None:
        self._setup = setup
        self._dataset: Any = loader.dataset if setup.dataset is None else setup.dataset
        self._iterable = is_iterable_dataset(loader.dataset)
        self._len_called = loader._IterableDataset_len_called
        self._auto_collation = loader.batch_sampler is not None
        self._drop_last = loader.drop_last
        self._index_sampler = loader._index_sampler
        self._num_workers = loader.num_workers
        self._timeout = loader.timeout
        self._collate_fn = loader.collate_fn if setup.collate_fn is None else setup.collate_fn
        self._persistent_workers = loader.persistent_workers
        self._telemetry = setup.telemetry
        self.records_delivery = True  # False when a DeviceIterator wraps this one and records
        # Run by the DeviceIterator wrapping this one, before gpu_transform: it finishes the
        # batches this iterator's workers were set up to make.
        self.device_tail = setup.device_tail

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
        # fastfeed pins for CUDA only; other accelerators get pageable batches.
        self._pin_memory = setup.pin_batches
        self.ring: SlotRing | None = None  # where this iterator's batches live, if anywhere

        self._random = RandomSources.of(loader)
        resume = setup.learned.take_resume()
        if resume is not None:
            resume.epoch_start.restore(self._random)
        self._epoch_start = EpochStart.capture(self._random)
        self._sampler_iter = iter(self._index_sampler)
        # Replay the epoch's draws exactly: a snapshot of a persistent iterator's later epoch
        # drew no base seed, and carries the one its workers had.
        self._draws_base_seed = resume is None or resume.draws_base_seed
        if self._draws_base_seed:
            self._base_seed = int(
                torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item()
            )
        else:
            assert resume is not None and resume.base_seed is not None
            self._base_seed = resume.base_seed
        self._num_yielded = 0
        self._skip_by_reading = 0
        self._exhausted = False
        self._resume = resume  # applied by the first _reset
        # IterableDataset.state_dict() after the last delivered batch, per replica.
        self._dataset_states: list[Any] = [None] * max(1, self._num_workers)

    def __iter__(self) -> BaseIterator:
        return self

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        # A snapshot applies only to a new iterator (load_state_dict drops a persistent one).
        resume, self._resume = self._resume, None
        if not first_iter:
            self._epoch_start = EpochStart.capture(self._random)
            self._draws_base_seed = False  # persistent workers keep theirs
        self._sampler_iter = iter(self._index_sampler)
        self._num_yielded = 0
        self._skip_by_reading = 0
        self._exhausted = False
        self._len_called = loader._IterableDataset_len_called
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

    def state_dict(self) -> LoaderState:
        """A snapshot from which a new loader resumes at the next batch of this epoch."""
        if self._exhausted:  # the next epoch: persistent workers will draw no base seed
            persistent = self._persistent_workers and self._num_workers > 0
            return LoaderState(epoch_start=EpochStart.capture(self._random),
                               draws_base_seed=not persistent,
                               base_seed=self._base_seed if persistent else None)
        has_states = any(state is not None for state in self._dataset_states)
        return LoaderState(
            batches_yielded=self._num_yielded,
            epoch_start=self._epoch_start,
            dataset_states=list(self._dataset_states) if has_states else None,
            draws_base_seed=self._draws_base_seed,
            base_seed=self._base_seed,
            **self._round_robin_position(),
        )

    def _round_robin_position(self) -> dict[str, Any]:
        return {}

    def _next_index(self) -> Any:
        return next(self._sampler_iter)  # StopIteration ends the epoch

    def _next_data(self) -> Any:
        raise NotImplementedError

    def _pin(self, batch: Any) -> Any:
        # Copies into torch's pinned pool, never pins the slot in place: the user drives the
        # copy, and torch guards only the pinned memory it allocated (DESIGN.md invariant 2).
        return pin_memory(batch, "cuda") if self._pin_memory else batch

    def _delivered(self) -> None:
        """Called after each batch is handed over (the worker pool tunes itself here)."""

    def __next__(self) -> Any:
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
        if self.records_delivery:
            self._telemetry.delivered(requested, batch_length(data, self._auto_collation))
        self._delivered()
        if self._iterable and self._len_called is not None and self._num_yielded > self._len_called:
            message = (
                f"Length of IterableDataset {self._dataset} was reported to be "
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
            warnings.warn(message, stacklevel=2)
        return data

    def __len__(self) -> int:
        return len(self._index_sampler)

    def close(self) -> None:
        """Stop the workers and free the ring now, not when the iterator is collected."""

    def __getstate__(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot be pickled")
