"""Every use of a torch internal, in one place.

FastLoader owns its iterators and workers, but some behaviour users rely on lives in torch's
private modules: the per-worker numpy seed, the module global behind
``torch.utils.data.get_worker_info()``, the wrapper a worker's exception travels in, and the
private attributes and hooks of ``DataLoader`` and its iterators (its index sampler, its
persistent iterator, its own ``_get_iterator``). Keeping those touches here makes a torch
upgrade a one-file review. (``FastLoader._get_iterator`` overrides torch's hook of that name:
that override is the one private name fastfeed defines rather than reads.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data._utils import collate as _collate
from torch.utils.data._utils import worker as _worker
from torch.utils.data.datapipes.datapipe import IterDataPipe, MapDataPipe

__all__ = [
    "DATALOADER_RUNTIME",
    "ExceptionWrapper",
    "auto_collation",
    "base_seed_of",
    "collate_tensor_fn",
    "collate_with",
    "default_collate",
    "default_convert",
    "drop_persistent_iterator",
    "has_primary_context",
    "index_sampler",
    "is_datapipe",
    "is_iterable_dataset",
    "iterable_len_called",
    "name_worker_process",
    "numpy_seed",
    "persistent_iterator",
    "pin_memory",
    "set_worker_info",
    "thread_worker_info",
    "torch_iterator",
]

# DataLoader's own state that a copy of a loader must not share: its persistent iterator.
DATALOADER_RUNTIME = ("_iterator",)

default_collate = _collate.default_collate
default_convert = _collate.default_convert
collate_tensor_fn = _collate.collate_tensor_fn


def collate_with(batch: list, tensor_fn: Callable[..., torch.Tensor]) -> Any:
    """``default_collate(batch)``, with ``tensor_fn`` stacking the tensor leaves.

    torch's extensible ``collate`` walks the structure (dicts, namedtuples, sequences, numpy
    arrays, numbers, strings) exactly as ``default_collate`` does; only the stacking changes.
    """
    fn_map = dict(_collate.default_collate_fn_map)
    fn_map[torch.Tensor] = tensor_fn
    return _collate.collate(batch, collate_fn_map=fn_map)


def numpy_seed(base_seed: int, worker_id: int) -> list[int]:
    """The numpy seed torch gives worker ``worker_id`` of an iterator with ``base_seed``."""
    return _worker._generate_state(base_seed, worker_id)


def set_worker_info(worker_id: int, num_workers: int, seed: int, dataset: Dataset) -> None:
    """Make ``torch.utils.data.get_worker_info()`` describe this worker."""
    _worker._worker_info = _worker.WorkerInfo(
        id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset
    )


def thread_worker_info(worker_id: int, num_workers: int, seed: int, dataset: Dataset) -> Any:
    """A WorkerInfo for a thread worker, with per-thread generators where torch supports them."""
    fields = set(getattr(_worker.WorkerInfo, "__dataclass_fields__", ()))
    extra: dict[str, Any] = {}
    if "rng" in fields and hasattr(_worker, "_RNG"):
        import random

        import numpy as np

        extra["rng"] = _worker._RNG(random.Random(seed), torch.Generator().manual_seed(seed),
                                    np.random.default_rng(seed))
    if "worker_method" in fields or not fields:  # torch 2.11's WorkerInfo takes any keyword
        extra["worker_method"] = "thread"
    return _worker.WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset,
                              **extra)


def auto_collation(loader: DataLoader) -> bool:
    """Whether ``loader`` batches samples itself (it has a batch sampler)."""
    return loader._auto_collation


def index_sampler(loader: DataLoader) -> Any:
    """What ``loader``'s iterators draw indices from: its batch sampler, or its sampler."""
    return loader._index_sampler


def iterable_len_called(loader: DataLoader) -> int | None:
    """The length ``len(loader)`` reported for an IterableDataset (None if never asked), which
    torch's iterators warn about when more batches come."""
    return loader._IterableDataset_len_called


def persistent_iterator(loader: DataLoader) -> Any:
    """The iterator ``loader`` keeps for its persistent workers (None before one is made)."""
    return loader._iterator


def drop_persistent_iterator(loader: DataLoader) -> None:
    """Make ``loader``'s next ``iter()`` build a new iterator (new persistent workers)."""
    loader._iterator = None


def torch_iterator(loader: DataLoader) -> Any:
    """The iterator torch's own ``DataLoader`` would make for ``loader``."""
    return DataLoader._get_iterator(loader)


def base_seed_of(iterator: Any) -> int:
    """The base seed a torch iterator drew for its workers."""
    return iterator._base_seed


def is_iterable_dataset(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset)


def is_datapipe(dataset: Any) -> bool:
    return isinstance(dataset, (IterDataPipe, MapDataPipe))


def pin_memory(data: Any, device: str | None = None) -> Any:
    """torch's structure-aware ``pin_memory`` (only called when CUDA is available)."""
    from torch.utils.data._utils.pin_memory import pin_memory as _pin

    return _pin(data, device)


def name_worker_process() -> None:
    """Name the worker as torch names its own (``pt_data_worker``), which ``ps``, ``top`` and
    ``py-spy`` show."""
    set_name = getattr(torch.multiprocessing, "_set_thread_name", None)
    if set_name is not None:
        set_name("pt_data_worker")


def has_primary_context(index: int) -> bool:
    """Whether CUDA device ``index`` has its primary context (anything run there made it),
    asked without making one (torch's own test of contexts uses it)."""
    return bool(torch._C._cuda_hasPrimaryContext(index))  # type: ignore[attr-defined]
