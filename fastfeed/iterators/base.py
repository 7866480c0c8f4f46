"""What every FastLoader iterator shares with torch's ``_BaseDataLoaderIter``.

The order of RNG draws matters for reproducibility: the base seed is drawn from
``loader.generator`` when the iterator is created, and the sampler draws on its first
``next``, exactly as in torch, so ``shuffle=True`` with the same seed gives the same order.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from fastfeed._torch_compat import is_iterable_dataset, pin_memory

if TYPE_CHECKING:
    from fastfeed.loader import FastLoader

__all__ = ["BaseIterator"]


class BaseIterator:
    """Sampler iteration, seeding, pinning and the IterableDataset length check."""

    def __init__(self, loader: FastLoader) -> None:
        self._dataset = loader.dataset
        self._iterable = is_iterable_dataset(loader.dataset)
        self._len_called = loader._IterableDataset_len_called
        self._auto_collation = loader.batch_sampler is not None
        self._drop_last = loader.drop_last
        self._index_sampler = loader._index_sampler
        self._num_workers = loader.num_workers
        self._timeout = loader.timeout
        self._collate_fn = loader.collate_fn
        self._persistent_workers = loader.persistent_workers

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
        self._pin_memory = loader.pin_memory and torch.cuda.is_available()

        self._sampler_iter = iter(self._index_sampler)
        self._base_seed = int(
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item()
        )
        self._num_yielded = 0

    def __iter__(self) -> BaseIterator:
        return self

    def _reset(self, loader: FastLoader, first_iter: bool = False) -> None:
        self._sampler_iter = iter(self._index_sampler)
        self._num_yielded = 0
        self._len_called = loader._IterableDataset_len_called

    def _next_index(self) -> Any:
        return next(self._sampler_iter)  # StopIteration ends the epoch

    def _next_data(self) -> Any:
        raise NotImplementedError

    def _pin(self, batch: Any) -> Any:
        return pin_memory(batch, "cuda") if self._pin_memory else batch

    def __next__(self) -> Any:
        data = self._next_data()
        self._num_yielded += 1
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

    def __getstate__(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot be pickled")
