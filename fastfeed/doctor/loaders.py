"""The script's loader, as arguments: rebuild it, or a variant of it, for the loader-alone runs.

A :class:`LoaderSpec` is read from the live loader when the window closes, from the attributes
``DataLoader`` keeps (as Lightning rebuilds loaders): the same dataset, the same sampler and
batch sampler objects, the same collate function, workers, seed generator and worker options,
and FastLoader's own options when the script's loader is one. A subclass's extra behaviour is
left out: Ultralytics' ``InfiniteDataLoader`` becomes a plain loader over its repeating batch
sampler, which costs the same per batch.

Every run starts from the same random state: the global generators are seeded and each
``torch.Generator`` the loader draws from (its own, its sampler's) is set back to the state it
had when the spec was read, so two loaders that keep the contract give the same batches.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from fastfeed.loader import OWN_OPTIONS, FastLoader

__all__ = ["LoaderSpec"]

_DATALOADER_ARGS = frozenset(inspect.signature(DataLoader.__init__).parameters)
# FastLoader's own keywords and defaults, but log_every: the doctor's runs must not log.
_FAST_OPTIONS = {name: default for name, default in OWN_OPTIONS.items() if name != "log_every"}


def _generators(loader: DataLoader) -> list[torch.Generator]:
    """The generators a loader draws from: its own, and its samplers' (nested ones too)."""
    found: list[torch.Generator] = []
    stack: list[Any] = [loader.generator, loader.sampler, loader.batch_sampler]
    for _ in range(8):
        if not stack:
            break
        item = stack.pop()
        if isinstance(item, torch.Generator):
            if all(item is not g for g in found):
                found.append(item)
        elif item is not None:
            stack += [getattr(item, "generator", None), getattr(item, "sampler", None)]
    return found


@dataclass
class LoaderSpec:
    """How to build the script's loader again.

    Attributes:
        kind: the script loader's class, qualified.
        fast: whether it was a FastLoader (then ``options`` holds its own options).
        dataset: the dataset it read.
        arguments: ``DataLoader`` keyword arguments, without ``dataset``.
        options: FastLoader-only keyword arguments.
        length: batches per epoch, or ``None`` when the loader has no length or never ends.
    """

    kind: str
    fast: bool
    dataset: Any
    arguments: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)
    length: int | None = None
    _states: list[tuple[torch.Generator, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def of(cls, loader: DataLoader) -> LoaderSpec:
        kind = f"{type(loader).__module__}.{type(loader).__qualname__}"
        arguments: dict[str, Any] = {
            "num_workers": loader.num_workers, "collate_fn": loader.collate_fn,
            "pin_memory": loader.pin_memory, "timeout": loader.timeout,
            "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context,
            "generator": loader.generator, "persistent_workers": loader.persistent_workers,
            "pin_memory_device": loader.pin_memory_device,
        }
        if "in_order" in _DATALOADER_ARGS:
            arguments["in_order"] = getattr(loader, "in_order", True)
        if loader.num_workers > 0:
            arguments["prefetch_factor"] = loader.prefetch_factor
        if isinstance(loader.dataset, IterableDataset):
            arguments.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
        elif loader.batch_sampler is not None:
            arguments["batch_sampler"] = loader.batch_sampler
        else:
            arguments.update(batch_size=None, sampler=loader.sampler)
        options: dict[str, Any] = {}
        fast = isinstance(loader, FastLoader)
        if isinstance(loader, FastLoader):
            options = {name: getattr(loader, name, default)
                       for name, default in _FAST_OPTIONS.items()}
            if loader.autotune:
                arguments["num_workers"] = "auto"
        try:
            length: int | None = len(loader)
        except TypeError:
            length = None
        # Only torch's BatchSampler is known to end: Ultralytics' repeating batch samplers
        # give the loader a length, but a loader rebuilt over them never ends an epoch.
        if length is not None and loader.batch_sampler is not None and not isinstance(
                loader.batch_sampler, torch.utils.data.BatchSampler):
            length = None
        spec = cls(kind, fast, loader.dataset, arguments, options, length)
        spec._states = [(g, g.get_state()) for g in _generators(loader)]
        return spec

    @property
    def batch_size(self) -> int | None:
        """Samples per batch; a batch sampler wrapped by another (Ultralytics' repeating
        one) is looked for inside it."""
        sampler = self.arguments.get("batch_sampler")
        for _ in range(3):
            if sampler is None:
                return self.arguments.get("batch_size")
            if isinstance(getattr(sampler, "batch_size", None), int):
                return sampler.batch_size
            sampler = getattr(sampler, "batch_sampler", getattr(sampler, "sampler", None))
        return None

    @property
    def workers(self) -> int | str:
        return self.arguments["num_workers"]

    def set_options(self) -> dict[str, Any]:
        """The FastLoader options the script set (those not at their defaults)."""
        return {name: value for name, value in self.options.items()
                if value is not _FAST_OPTIONS[name] and value != _FAST_OPTIONS[name]}

    def build(self, fast: bool | None = None, dataset: Any = None,
              kind: type[DataLoader] | None = None, **changes: Any) -> DataLoader:
        """The loader again: a FastLoader if ``fast`` (default: as the script's), over
        ``dataset`` (default: the script's), with ``changes`` to its arguments. ``kind``: a
        loader class of the same contract to build instead (a FastLoader subclass if
        ``fast``)."""
        fast = self.fast if fast is None else fast
        arguments = {**self.arguments, **(self.options if fast else {}), **changes}
        if "num_workers" in changes and changes["num_workers"] == 0:
            arguments.pop("prefetch_factor", None)
            arguments["persistent_workers"] = False
        if not fast and arguments["num_workers"] == "auto":
            raise ValueError("num_workers='auto' needs FastLoader")
        kind = kind or (FastLoader if fast else DataLoader)
        return kind(self.dataset if dataset is None else dataset, **arguments)

    def inner_batch_sampler(self) -> Any:
        """The batch sampler a repeating one wraps (Ultralytics' ``_RepeatSampler``), for a
        loader class that repeats it itself; the batch sampler itself otherwise."""
        sampler = original = self.arguments.get("batch_sampler")
        for _ in range(3):
            if isinstance(sampler, torch.utils.data.BatchSampler):
                return sampler
            inner = getattr(sampler, "sampler", None)
            sampler = inner if inner is not None else getattr(sampler, "batch_sampler", None)
        return original

    def reset_random(self, seed: int = 0) -> None:
        """Seed the global generators and set the loader's own back to their first state."""
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        for generator, state in self._states:
            generator.set_state(state)
