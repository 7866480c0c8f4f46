"""``SharedList``: a read-only sequence whose elements are decoded from shared memory on each
read, so that reading it writes nothing the process shares."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from fastfeed.shared_lists.columns import VALUES, SequenceLayout, column_reader

__all__ = ["SharedList"]


def _read_only(self: SharedList, *args: Any, **kwargs: Any) -> NoReturn:
    raise TypeError(
        f"this {self.container.__name__} is fastfeed's read-only shared copy of the dataset's, "
        "read by the workers in place of the original (which each worker would otherwise copy "
        "as it reads it); change it in the main process, or build the loader with "
        "share_lists=False to give each worker a private copy it can change")


class SharedList(Sequence):
    """A read-only sequence of plain values (see :mod:`fastfeed.shared_lists.columns`), read
    from a mapping that every worker shares.

    It answers ``len``, indexing (ints and slices; a slice is a new ``list`` or ``tuple``, as the
    original's would be), iteration, ``in``, ``index``, ``count``, ``==`` with the original's
    type, ``+`` and ``repr`` as the original ``list`` or ``tuple`` did, with elements of the
    same types and values (a float NaN, a new object on each read, is not ``==`` itself).
    Changing it raises ``TypeError``; pickling or copying it gives a plain copy of the original
    type.

    Args:
        memory: the read-only mapping the elements are encoded in.
        layout: where this sequence's arrays are in ``memory``.
    """

    __slots__ = ("_length", "_read", "container")

    def __init__(self, memory: memoryview, layout: SequenceLayout) -> None:
        self._length = layout.length
        self.container = layout.container  # list or tuple: what the original was
        readers = [column_reader(column, memory) for column in layout.columns]
        if layout.arity == VALUES:
            self._read = readers[0]
        else:
            self._read = lambda i: tuple([read(i) for read in readers])

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.container(map(self._read, range(*index.indices(self._length))))
        i = operator.index(index)
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(f"{self.container.__name__} index out of range")
        return self._read(i)

    def __iter__(self) -> Iterator[Any]:
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

    def __repr__(self) -> str:
        return repr(self.container(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return self.container, (list(self),)

    # What would change a list: not this one.
    append = extend = insert = remove = pop = clear = sort = reverse = _read_only
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only
