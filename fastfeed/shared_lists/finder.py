"""Which lists of a dataset are shared: the large sequences of plain values among its own
attributes and those of the datasets it wraps."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import Dataset

__all__ = ["MIN_LENGTH", "Found", "find_lists"]

# Shorter lists cost a worker little when it copies them (10,000 (path, class) pairs are about
# 1.5 MB of objects) and are read as they are.
MIN_LENGTH = 10_000


@dataclass(eq=False)
class Found:
    """A large list or tuple, and every attribute that holds it: ``(object, name)`` pairs
    (torchvision's ``DatasetFolder`` holds its ``samples`` as ``imgs`` too)."""

    sequence: list | tuple
    owners: list[tuple[Any, str]] = field(default_factory=list)


def find_lists(dataset: Any) -> list[Found]:
    """The lists and tuples of at least :data:`MIN_LENGTH` elements held in the instance
    attributes of ``dataset`` and of the datasets it wraps, each once.

    A wrapped dataset is an attribute that is a ``torch.utils.data.Dataset`` (``Subset.dataset``,
    an accelerated copy's), or one in a shorter list or tuple (``ConcatDataset.datasets``).
    Whether a found sequence holds only plain values is decided when it is encoded.
    """
    found: dict[int, Found] = {}
    for owner, name, sequence in _sequences(dataset, MIN_LENGTH):
        found.setdefault(id(sequence), Found(sequence)).owners.append((owner, name))
    return list(found.values())


def _sequences(dataset: Any, min_length: int) -> Iterator[tuple[Any, str, list | tuple]]:
    seen: set[int] = set()
    pending = [dataset]
    while pending:
        holder = pending.pop()
        if id(holder) in seen:
            continue
        seen.add(id(holder))
        attributes = getattr(holder, "__dict__", None)
        if not isinstance(attributes, dict):  # __slots__, or a class
            continue
        for name, value in attributes.items():
            if type(value) in (list, tuple):
                if len(value) >= min_length:
                    yield holder, name, value
                else:
                    pending.extend(v for v in value if isinstance(v, Dataset))
            elif isinstance(value, Dataset):
                pending.append(value)
