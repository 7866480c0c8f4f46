"""``FastLoader``: a ``torch.utils.data.DataLoader`` that feeds the GPU."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch.utils.data import DataLoader, Dataset, Sampler

from fastfeed._torch_compat import is_datapipe
from fastfeed.iterators import SingleProcessIterator, WorkerPoolIterator

__all__ = ["FastLoader"]


class FastLoader(DataLoader):
    r"""A drop-in replacement for :class:`torch.utils.data.DataLoader`.

    ``FastLoader`` *is a* ``DataLoader``: it accepts the same arguments with the same defaults,
    validates them with the same errors, exposes the same attributes, and yields the same
    batches in the same order for the same seed. Frameworks that check
    ``isinstance(loader, DataLoader)`` or rebuild a loader from its attributes keep working.

    With ``num_workers > 0`` it uses its own worker pool. Workers collate each batch directly
    into a slot of a shared-memory ring and send only a small message; the main process
    rebuilds the batch as tensors that are views of that slot. A slot returns to the ring only
    when nothing references the batch any more. When every slot is in use, batches take
    torch's ordinary shared-memory path, so nothing is ever overwritten.

    Args:
        dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
        pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
        prefetch_factor, persistent_workers, pin_memory_device, in_order: as in
            :class:`torch.utils.data.DataLoader`.
        ring_slots (int, optional): how many ring slots the worker pool may allocate. ``None``
            (default) allocates ``prefetch_factor * num_workers + 2``: enough for every
            in-flight task, the batch being returned and the one the training loop still
            holds. ``0`` disables the ring. Memory is about ``ring_slots`` times the size of
            one batch's tensors (plus 25 % headroom once batch sizes vary).

    Example:
        >>> from fastfeed import FastLoader as DataLoader
        >>> loader = DataLoader(dataset, batch_size=256, shuffle=True, num_workers=8)
        >>> for images, targets in loader:
        ...     ...
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler | Iterable | None = None,
        batch_sampler: Sampler[list] | Iterable[list] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        ring_slots: int | None = None,
    ) -> None:
        if ring_slots is not None and (
            isinstance(ring_slots, bool) or not isinstance(ring_slots, int) or ring_slots < 0
        ):
            raise ValueError(f"ring_slots should be None or a non-negative int, got {ring_slots!r}")
        self.ring_slots = ring_slots
        # Learned by the first iterator, so later epochs' rings start at the right size.
        self._ring_slot_bytes = 0
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )

    def _get_iterator(self) -> Any:
        if is_datapipe(self.dataset):
            # DataPipes (deprecated in torch) need torch's sharding hooks: use torch's iterators.
            return super()._get_iterator()
        if self.num_workers == 0:
            return SingleProcessIterator(self)
        self.check_worker_number_rationality()
        return WorkerPoolIterator(self)
