"""The stages timed in a worker process of the script's own kind.

A loader worker is a process with one intra-op thread and nothing else running in it. The
doctor's measuring process is not: the script's own threads may still hold the GIL at times,
and its memory and caches are the training loop's. Timed there, on a busy machine, the
stages read slower than the workers run them, and the doctor then had to rule its own
figures out against the rate the loader was measured at. So the stages are timed where the
workers run them: in one worker of a loader built with the script's start method and
``worker_init_fn``, over a one-item dataset whose item is the timing itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset

from fastfeed.doctor.stages import StageCost, profile_samples

__all__ = ["profile_in_worker"]

# Beyond the timing budget: the worker's start (spawn imports torch) and one slow sample.
_START_S = 120.0


class _Timing(Dataset):
    """One item: :func:`~fastfeed.doctor.stages.profile_samples` over ``dataset``, run where
    the item is read."""

    def __init__(self, dataset: Any, collate_fn: Callable[[Any], Any] | None,
                 batch_size: int | None, budget_s: float) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn
        self.batch_size, self.budget_s = batch_size, budget_s

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> tuple[list[StageCost], Any]:
        return profile_samples(self.dataset, self.collate_fn, self.batch_size, self.budget_s)


def _as_is(item: Any) -> Any:
    return item  # the costs and the batch as the worker made them (no default_convert)


def profile_in_worker(dataset: Any, collate_fn: Callable[[Any], Any] | None,
                      batch_size: int | None, budget_s: float,
                      multiprocessing_context: Any = None,
                      worker_init_fn: Callable[[int], None] | None = None
                      ) -> tuple[list[StageCost], Any]:
    """:func:`~fastfeed.doctor.stages.profile_samples` in one worker process started as the
    script's loader starts its workers (its ``multiprocessing_context`` and
    ``worker_init_fn``); the costs and the last batch collated come back with it."""
    loader = DataLoader(_Timing(dataset, collate_fn, batch_size, budget_s), batch_size=None,
                        num_workers=1, collate_fn=_as_is, worker_init_fn=worker_init_fn,
                        multiprocessing_context=multiprocessing_context,
                        timeout=_START_S + 2 * budget_s)
    costs, batch = next(iter(loader))
    return costs, batch
