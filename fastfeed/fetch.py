"""Fetchers: turn an index (or a batch of indices) into samples, exactly as torch does.

Collation is left to the caller, so that workers can collate straight into a pool slot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Fetcher", "IterableFetcher", "MapFetcher"]


class Fetcher:
    """Fetches the samples for one index; ``auto_collation`` means the index is a batch.

    ``reseed(index)``, when given, runs before each sample is read (``deterministic=True``),
    so that a sample's random state does not depend on which worker reads it.
    """

    def __init__(self, dataset: Any, auto_collation: bool, drop_last: bool,
                 reseed: Callable[[Any], None] | None = None) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.drop_last = drop_last
        self.reseed = reseed

    def fetch(self, index: Any) -> Any:
        raise NotImplementedError


class MapFetcher(Fetcher):
    def fetch(self, index: Any) -> Any:
        if not self.auto_collation:
            return self._read(index)
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems:
            if self.reseed is not None and len(index):
                self.reseed(index[0])  # one draw per batch: the dataset reads them together
            return getitems(index)
        return [self._read(i) for i in index]

    def _read(self, index: Any) -> Any:
        if self.reseed is not None:
            self.reseed(index)
        return self.dataset[index]


class IterableFetcher(Fetcher):
    def __init__(self, dataset: Any, auto_collation: bool, drop_last: bool) -> None:
        super().__init__(dataset, auto_collation, drop_last)
        self._iterator: Iterator = iter(dataset)
        self._ended = False

    def fetch(self, index: Any) -> Any:
        if self._ended:
            raise StopIteration
        if not self.auto_collation:
            return next(self._iterator)
        samples = []
        for _ in index:
            try:
                samples.append(next(self._iterator))
            except StopIteration:
                self._ended = True
                break
        if not samples or (self.drop_last and len(samples) < len(index)):
            raise StopIteration
        return samples


def make_fetcher(dataset: Any, iterable: bool, auto_collation: bool, drop_last: bool,
                 reseed: Callable[[Any], None] | None = None) -> Fetcher:
    if iterable:
        return IterableFetcher(dataset, auto_collation, drop_last)
    return MapFetcher(dataset, auto_collation, drop_last, reseed)
