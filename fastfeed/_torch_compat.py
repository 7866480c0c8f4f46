"""Every use of a torch internal, in one place.

FastLoader owns its iterators and workers, but some behaviour users rely on lives in torch's
private modules: the per-worker numpy seed, and the module global behind
``torch.utils.data.get_worker_info()``. Keeping those touches here makes a torch upgrade a
one-file review.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data._utils import collate as _collate
from torch.utils.data._utils import worker as _worker
from torch.utils.data.datapipes.datapipe import IterDataPipe, MapDataPipe

__all__ = [
    "auto_collation",
    "collate_tensor_fn",
    "collate_with",
    "default_collate",
    "default_convert",
    "is_datapipe",
    "is_iterable_dataset",
    "name_worker_process",
    "numpy_seed",
    "pin_memory",
    "set_worker_info",
    "thread_worker_info",
]

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
    if "worker_method" in fields:
        extra["worker_method"] = "thread"
    return _worker.WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset,
                              **extra)


def auto_collation(loader: DataLoader) -> bool:
    """Whether ``loader`` batches samples itself (it has a batch sampler)."""
    return loader._auto_collation


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
