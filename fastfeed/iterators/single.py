"""``num_workers=0``: the produce step in the calling thread, as torch does."""

from __future__ import annotations

from torch.utils.data import DataLoader

from fastfeed.iterators.base_iterator import BaseIterator, HostBatch
from fastfeed.iterators.host_plan import HostPlan
from fastfeed.produce import Producer

__all__ = ["SingleProcessIterator"]


class SingleProcessIterator(BaseIterator):
    """Loads every batch in the main process; there is nothing to cross, so no slot pool."""

    def __init__(self, loader: DataLoader, plan: HostPlan) -> None:
        super().__init__(loader, plan)
        if self._timeout != 0:
            # torch's single-process iterator refuses a timeout with the same exception type.
            raise AssertionError("timeout requires num_workers > 0 (got timeout="
                                 f"{self._timeout} with num_workers=0)")
        # As torch's: the sampler is iterated once per iterator (a batch sampler that draws
        # in __iter__ draws once).
        self._start_epoch(loader, first_iter=True)
        self._producer = Producer(self._worker_config(0), in_main_process=True)
        self._producer.start_epoch(0, self._dataset_states[0])

    def _next_data(self) -> HostBatch:
        produced = self._producer.produce(self._next_index())
        self._telemetry.record_produced(produced, by_worker=False)
        if produced.dataset_state is not None:
            self._dataset_states[0] = produced.dataset_state
        return HostBatch(produced.batch, None)
