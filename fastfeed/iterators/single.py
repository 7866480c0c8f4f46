"""``num_workers=0``: fetch and collate in the calling thread, as torch does."""

from __future__ import annotations

import time
from typing import Any

from torch.utils.data import DataLoader

from fastfeed.fetch import make_fetcher
from fastfeed.iterators.base import BaseIterator
from fastfeed.iterators.setup import IteratorSetup
from fastfeed.resume import has_snapshot_protocol
from fastfeed.skip import drop_skipped

__all__ = ["SingleProcessIterator"]


class SingleProcessIterator(BaseIterator):
    """Loads every batch in the main process; there is nothing to cross, so no ring."""

    def __init__(self, loader: DataLoader, setup: IteratorSetup) -> None:
        super().__init__(loader, setup)
        if self._timeout != 0:
            # torch's single-process iterator refuses a timeout with the same exception type.
            raise AssertionError("timeout requires num_workers > 0 (got timeout="
                                 f"{self._timeout} with num_workers=0)")
        self._reset(loader, first_iter=True)

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        self._tracks_state = self._iterable and has_snapshot_protocol(self._dataset)
        if self._tracks_state and self._dataset_states[0] is not None:
            self._dataset.load_state_dict(self._dataset_states[0])
        self._fetcher = make_fetcher(
            self._dataset, self._iterable, self._auto_collation, self._drop_last
        )

    def _next_data(self) -> Any:
        index = self._next_index()
        start = time.perf_counter()
        samples, skipped = drop_skipped(self._fetcher.fetch(index), self._auto_collation)
        self._telemetry.skipped += skipped
        if self._tracks_state:
            self._dataset_states[0] = self._dataset.state_dict()
        fetched = time.perf_counter()
        batch = self._collate_fn(samples)
        self._telemetry.add_stage("fetch", fetched - start)
        self._telemetry.add_stage("collate", time.perf_counter() - fetched)
        return self._pin(batch)
