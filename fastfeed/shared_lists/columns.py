"""A sequence of plain values as flat arrays, and back: the encoding behind :class:`SharedList`.

A *value* is one of six kinds: ``None``, ``bool``, ``int`` (within int64), ``float``, ``str`` and
``bytes``. The elements of an encodable sequence are either all values, or all tuples of the
same length ``k`` of values (``ImageFolder.samples`` holds ``(path, class)`` pairs). Each tuple
position is a *column* (the values alone make one), stored as up to four arrays:

- ``kinds``: the kind of each value, only when the column mixes kinds (one kind is stored once);
- ``words``: an int64 per value: the int, the bool, or the float's bits;
- ``offsets`` and ``blob``: each ``str`` (UTF-8 with ``surrogatepass``, so that any string comes
  back, file names with undecodable bytes included) and each ``bytes`` end to end in ``blob``,
  value ``i`` between ``offsets[i]`` and ``offsets[i + 1]``.

Encoding works on whole columns with numpy and ``str.join`` (no Python loop per element for a
column of one kind): 1.28M ``(path, class)`` pairs take about a third of a second.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Generic, TypeVar

import numpy as np

__all__ = ["Column", "EncodedSequence", "Layout", "Part", "SequenceLayout", "column_reader",
           "encode_sequence"]

A = TypeVar("A")  # what a column's arrays are: the arrays themselves, or where they are placed

# The kinds of value, as stored in a column's ``kinds`` array.
NONE, BOOL, INT, FLOAT, STR, BYTES = range(6)
_KIND_OF: dict[type, int] = {type(None): NONE, bool: BOOL, int: INT, float: FLOAT, str: STR,
                             bytes: BYTES}
_NUMBERS = (BOOL, INT, FLOAT)
_TEXTS = (STR, BYTES)
MIXED = -1  # a column's kind when its values are of several kinds
VALUES = -1  # a sequence's arity when its elements are values, not tuples


@dataclass(frozen=True)
class Part:
    """Where one array lives in a mapping: its byte offset and size."""

    offset: int
    nbytes: int


@dataclass(frozen=True)
class Column(Generic[A]):
    """One column: its kind (or ``MIXED``) and the arrays it needs (None: not needed), as
    arrays once encoded, as :class:`Part` once placed in a mapping."""

    kind: int
    kinds: A | None
    words: A | None
    offsets: A | None
    blob: A | None

    def placed(self, put: Callable[[A | None], Part | None]) -> Column[Part]:
        return Column(self.kind, put(self.kinds), put(self.words), put(self.offsets),
                      put(self.blob))


@dataclass(frozen=True)
class Layout(Generic[A]):
    """A sequence: ``length`` elements of ``arity`` values each (``VALUES``: bare values) in a
    ``container`` (``list`` or ``tuple``), and its columns. Placed in a mapping, it is small
    and picklable: what a worker needs to read the sequence."""

    length: int
    arity: int
    container: type
    columns: tuple[Column[A], ...]


EncodedSequence = Layout[np.ndarray | bytes]
SequenceLayout = Layout[Part]


# -- encoding ----------------------------------------------------------------------------------

def encode_sequence(sequence: Sequence[Any]) -> EncodedSequence | None:
    """``sequence`` (a ``list`` or ``tuple``) as columns, or None if it holds anything but
    values and tuples of values of one length (or an int beyond int64), or only values of which
    CPython keeps one object (reading those copies nothing)."""
    shapes = set(map(type, sequence))
    if shapes == {tuple}:
        arities = set(map(len, sequence))
        if len(arities) != 1:
            return None
        (arity,) = arities
        columns = [list(map(itemgetter(j), sequence)) for j in range(arity)]
    elif shapes <= _KIND_OF.keys():
        arity, columns = VALUES, [list(sequence)]
    else:
        return None
    encoded = []
    for values in columns:
        column = _encode_column(values)
        if column is None:
            return None
        encoded.append(column)
    if arity == VALUES and _one_object_each(encoded[0]):
        return None
    return Layout(len(sequence), arity, type(sequence), tuple(encoded))


def _one_object_each(column: Column[np.ndarray | bytes]) -> bool:
    """Whether each value of ``column`` is an object CPython keeps one of (``None``, the bools,
    the small ints from -5 to 256): ``[None] * n`` or the class labels of CIFAR are never copied
    by being read, since every element is the same few objects."""
    kinds = np.full(1, column.kind) if column.kind != MIXED else np.asarray(column.kinds)
    if not np.isin(kinds, (NONE, BOOL, INT)).all():
        return False
    if INT not in kinds:
        return True
    words = np.asarray(column.words)
    ints = words if column.kind == INT else words[kinds == INT]
    return int(ints.min()) >= -5 and int(ints.max()) <= 256


def _encode_column(values: list[Any]) -> Column[np.ndarray | bytes] | None:
    present = set(map(type, values))
    if not present <= _KIND_OF.keys():
        return None
    kinds = sorted(_KIND_OF[t] for t in present)
    codes = None  # one kind: stored once, not per value
    if len(kinds) > 1:
        codes = np.fromiter(map(_KIND_OF.__getitem__, map(type, values)), np.uint8, len(values))

    def members(wanted: tuple[int, ...]) -> tuple[np.ndarray | None, list[Any]]:
        """The positions of the values of the ``wanted`` kinds (None: all), and those values."""
        if codes is None:
            return None, values
        where = np.flatnonzero(np.isin(codes, wanted))
        return where, [values[i] for i in where.tolist()]

    words = offsets = blob = None
    numbers = [kind for kind in kinds if kind in _NUMBERS]
    if numbers:
        pieces = []
        for kind in numbers:
            where, chosen = members((kind,))
            try:
                pieces.append((where, _words(kind, chosen)))
            except OverflowError:  # an int beyond int64
                return None
        words = _scatter(len(values), pieces)
    texts = tuple(kind for kind in kinds if kind in _TEXTS)
    if texts:
        where, chosen = members(texts)
        blob, lengths = _texts(chosen, all_str=texts == (STR,))
        offsets = np.zeros(len(values) + 1, np.int64)
        np.cumsum(_scatter(len(values), [(where, lengths)]), out=offsets[1:])
    return Column(kinds[0] if codes is None else MIXED, codes, words, offsets, blob)


def _scatter(length: int, pieces: list[tuple[np.ndarray | None, np.ndarray]]) -> np.ndarray:
    """One int64 array of ``length`` from arrays each meant for some positions (None: all)."""
    if len(pieces) == 1 and pieces[0][0] is None:
        return pieces[0][1]
    whole = np.zeros(length, np.int64)
    for where, array in pieces:
        whole[where] = array
    return whole


def _words(kind: int, values: list[Any]) -> np.ndarray:
    if kind == FLOAT:
        return np.array(values, dtype=np.float64).view(np.int64)
    return np.array(values, dtype=np.int64)  # ints, and bools as 0 and 1


def _texts(values: list[Any], all_str: bool) -> tuple[bytes, np.ndarray]:
    """The values' bytes end to end, and each one's length."""
    if all_str:
        joined = "".join(values)
        if joined.isascii():  # a byte per character: no encoding one by one
            return joined.encode("ascii"), np.fromiter(map(len, values), np.int64, len(values))
    parts = [v.encode("utf-8", "surrogatepass") if type(v) is str else v for v in values]
    return b"".join(parts), np.fromiter(map(len, parts), np.int64, len(parts))


# -- reading -----------------------------------------------------------------------------------

def _none(_: int) -> None:
    return None


def column_reader(layout: Column[Part], memory: memoryview) -> Callable[[int], Any]:
    """A function from a position to the column's value there, read from ``memory``."""

    def view(part: Part | None, fmt: Any) -> Any:  # fmt: a struct format, "q", "d" or "B"
        return None if part is None else \
            memory[part.offset:part.offset + part.nbytes].cast(fmt)

    words, floats = view(layout.words, "q"), view(layout.words, "d")
    offsets, blob = view(layout.offsets, "q"), view(layout.blob, "B")

    def text(i: int) -> str:
        return str(blob[offsets[i]:offsets[i + 1]], "utf-8", "surrogatepass")

    def raw(i: int) -> bytes:
        return blob[offsets[i]:offsets[i + 1]].tobytes()

    readers: dict[int, Callable[[int], Any]] = {NONE: _none, STR: text, BYTES: raw}
    if words is not None:
        readers.update({BOOL: lambda i: words[i] != 0, INT: words.__getitem__,
                        FLOAT: floats.__getitem__})
    if layout.kind != MIXED:
        return readers[layout.kind]
    kinds = view(layout.kinds, "B")
    return lambda i: readers[kinds[i]](i)
