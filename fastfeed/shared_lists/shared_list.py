"""``SharedList``: a sequence whose elements are decoded from shared memory on each read, so
that reading it writes nothing the process shares."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fastfeed.shared_lists.columns import VALUES, SequenceLayout, column_reader

__all__ = ["SharedList"]


def _changing(name: str) -> Callable[..., Any]:
    """List method ``name``, run on the process's own copy (a tuple has no such method)."""

    def change(self: SharedList, *args: Any, **kwargs: Any) -> Any:
        if self.container is not list:
            raise AttributeError(f"'tuple' object has no attribute '{name}'")
        return getattr(self._own(), name)(*args, **kwargs)

    change.__name__ = name
    return change


class SharedList(Sequence):
    """A sequence of plain values (see :mod:`fastfeed.shared_lists.columns`), read from a
    mapping that every worker shares, in the place of the dataset's ``list`` or ``tuple``.

    It answers ``len``, indexing (ints and slices; a slice is a new ``list`` or ``tuple``, as the
    original's would be), iteration, ``in``, ``index``, ``count``, ``==`` with the original's
    type, ``+``, ``*`` and ``repr`` as the original did, with elements of the same types and
    values (a float NaN, a new object on each read, is not ``==`` itself). Pickling or copying
    it gives a plain copy of the original type.

    Changing it (``append``, ``samples[i] = ...``, ``sort``, any ``list`` method that changes a
    list) first makes this process its own ``list`` of the elements, on which the change and
    every later read are made: the shared copy is never written, and the process holds what the
    stock loader's worker would have held from the start.

    Args:
        memory: the read-only mapping the elements are encoded in.
        layout: where this sequence's arrays are in ``memory``.
    """

    __slots__ = ("_length", "_private", "_read", "container")

    def __init__(self, memory: memoryview, layout: SequenceLayout) -> None:
        self._length = layout.length
        self.container = layout.container  # list or tuple: what the original was
        self._private: list | None = None  # this process's own copy, once changed
        readers = [column_reader(column, memory) for column in layout.columns]
        if layout.arity == VALUES:
            self._read = readers[0]
        else:
            self._read = lambda i: tuple([read(i) for read in readers])

    def _own(self) -> list:
        """This process's own copy of the elements, made at the first change."""
        if self._private is None:
            self._private = list(map(self._read, range(self._length)))
        return self._private

    def __len__(self) -> int:
        return self._length if self._private is None else len(self._private)

    def __getitem__(self, index: Any) -> Any:
        if self._private is not None:
            return self._private[index]
        if isinstance(index, slice):
            return self.container(map(self._read, range(*index.indices(self._length))))
        i = operator.index(index)
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(f"{self.container.__name__} index out of range")
        return self._read(i)

    def __iter__(self) -> Iterator[Any]:
        if self._private is not None:
            return iter(self._private)
        return map(self._read, range(self._length))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SharedList):
            if other.container is not self.container:
                return False  # as a list is never equal to a tuple
        elif type(other) is not self.container:
            return NotImplemented
        assert isinstance(other, Sequence)
        return len(self) == len(other) and all(map(operator.eq, self, other))

    def __hash__(self) -> int:
        if self.container is not tuple:
            raise TypeError(f"unhashable type: '{self.container.__name__}'")
        return hash(tuple(self))

    def __add__(self, other: Any) -> Any:
        return self.container(self) + other

    def __radd__(self, other: Any) -> Any:
        return other + self.container(self)

    def __mul__(self, times: Any) -> Any:
        return self.container(self) * times

    __rmul__ = __mul__

    def __repr__(self) -> str:
        return repr(self.container(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return self.container, (list(self),)

    # A list changes in place: this one changes its own copy. A tuple never does (``+=``
    # makes a new tuple, from ``__add__``).
    append, extend, insert, remove, pop, clear, sort, reverse = map(_changing, (
        "append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse"))

    def __setitem__(self, index: Any, value: Any) -> None:
        if self.container is not list:
            raise TypeError("'tuple' object does not support item assignment")
        self._own()[index] = value

    def __delitem__(self, index: Any) -> None:
        if self.container is not list:
            raise TypeError("'tuple' object doesn't support item deletion")
        del self._own()[index]

    def __iadd__(self, other: Any) -> Any:
        if self.container is not list:
            return NotImplemented
        self._own().extend(other)
        return self

    def __imul__(self, times: Any) -> Any:
        if self.container is not list:
            return NotImplemented
        private = self._own()
        private *= times
        return self
