"""SharedList: the packed, read-only copy reads back every element with its exact type and
value, and behaves as the original list or tuple where it can."""

import copy
import math
import os
import pickle

import pytest

from fastfeed.shared_lists import SharedList
from fastfeed.shared_lists.columns import encode_sequence
from fastfeed.shared_lists.packing import PackedLists

VALUES = [None, True, False, 0, -1, 2**63 - 1, -(2**63), 1.5, -0.0, math.inf, "", "path.jpg",
          "é🙂", "bad\udcff", b"", b"\x00\xff"]


def shared(sequence):
    encoded = encode_sequence(sequence)
    assert encoded is not None
    packed = PackedLists.pack([encoded])
    packed.close_fd()
    return packed.lists[0]


def assert_exact(got, want):
    assert type(got) is type(want) and len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert type(a) is type(b) and a == b, (a, b)
        if isinstance(a, tuple):
            assert [type(x) for x in a] == [type(x) for x in b]


@pytest.mark.parametrize("sequence", [
    VALUES * 3,  # one column of mixed kinds
    [f"/data/c{i % 5}/{i}.jpg" for i in range(1000)],  # ASCII paths
    [f"/données/ç{i}/é.jpg" for i in range(100)],  # UTF-8 paths
    [i * 7 for i in range(1000)],
    [i / 3 for i in range(100)],
    [bytes([i % 256]) * (i % 4) for i in range(100)],
    [(f"/data/{i}.jpg", i % 3) for i in range(1000)],  # ImageFolder.samples
    [(i, None if i % 2 else "x", i / 2, b"b", i % 3 == 0) for i in range(300)],
    [()] * 5,
    tuple((f"p{i}", i) for i in range(50)),  # a tuple stays a tuple
], ids=["mixed", "ascii", "utf8", "ints", "floats", "bytes", "samples", "rows",
        "empty-tuples", "tuple"])
def test_every_element_reads_back_with_its_type(sequence):
    copy_ = shared(sequence)
    assert len(copy_) == len(sequence)
    assert_exact(copy_[:], sequence)
    assert_exact(type(sequence)(copy_), sequence)
    for i in (0, len(sequence) // 2, -1, -len(sequence)):
        assert copy_[i] == sequence[i] and type(copy_[i]) is type(sequence[i])
    assert copy_ == sequence
    assert (copy_ != sequence) is False


def test_it_behaves_as_a_read_only_list():
    original = [(f"/data/{i}.jpg", i) for i in range(20)]
    copy_ = shared(original)
    assert_exact(copy_[3:17:4], original[3:17:4])
    assert_exact(copy_[::-1], original[::-1])
    assert list(reversed(copy_)) == original[::-1]
    assert original[5] in copy_ and ("no", 0) not in copy_
    assert copy_.index(original[7]) == 7 and copy_.count(original[7]) == 1
    assert copy_ + [("x", 1)] == original + [("x", 1)]  # noqa: RUF005 (what is tested)
    assert [("x", 1)] + copy_ == [("x", 1)] + original  # noqa: RUF005
    assert repr(copy_) == repr(original)
    assert copy_ != tuple(original)  # as a list is never equal to a tuple
    with pytest.raises(IndexError):
        copy_[20]
    with pytest.raises(TypeError):
        copy_["0"]
    with pytest.raises(TypeError, match="unhashable"):
        hash(copy_)
    assert copy_ * 2 == original * 2 and 2 * copy_ == 2 * original


CHANGES = [
    lambda s: s.append(("y", 2)), lambda s: s.extend([("z", 3)]), lambda s: s.insert(1, ("w", 0)),
    lambda s: s.remove(("/data/3.jpg", 3)), lambda s: s.pop(), lambda s: s.pop(0),
    lambda s: s.clear(), lambda s: s.sort(reverse=True), lambda s: s.reverse(),
    lambda s: s.__setitem__(0, ("v", 9)), lambda s: s.__setitem__(slice(2, 5), []),
    lambda s: s.__delitem__(-1), lambda s: s.__iadd__([("u", 1)]), lambda s: s.__imul__(2),
]


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_makes_a_private_copy_as_a_list_would_change(change):
    original = [(f"/data/{i}.jpg", i) for i in range(20)]
    packed = encode_sequence(original)
    memory = PackedLists.pack([packed])
    copy_, expected = memory.lists[0], list(original)
    assert change(copy_) == change(expected)  # what it returns: pop's element, None, itself
    assert_exact(copy_[:], expected)
    assert len(copy_) == len(expected) and list(copy_) == expected and copy_ == expected
    assert memory.lists[0] is copy_ and PackedLists.attach(
        memory.fd, memory.nbytes, memory.layouts).lists[0] == original  # the shared copy
    memory.close_fd()


def test_a_tuple_does_not_change():
    copy_ = shared(tuple(range(300, 330)))
    with pytest.raises(AttributeError):
        copy_.append(1)
    with pytest.raises(TypeError):
        copy_[0] = 1
    grown = copy_
    grown += (1,)  # a new tuple, as for a tuple
    assert type(grown) is tuple and len(grown) == 31 and len(copy_) == 30


def test_a_tuple_is_hashable_and_copies_are_plain():
    original = tuple(range(300, 330))
    copy_ = shared(original)
    assert hash(copy_) == hash(original)
    for duplicate in (pickle.loads(pickle.dumps(copy_)), copy.copy(copy_), copy.deepcopy(copy_)):
        assert type(duplicate) is tuple and duplicate == original
    listed = shared(list(original))
    assert type(pickle.loads(pickle.dumps(listed))) is list


@pytest.mark.parametrize("sequence", [
    [{"path": "a"}] * 3,  # dicts
    [["a", 1]] * 3,  # lists inside
    [("a", 1), ("b",)],  # tuples of different lengths
    [("a", 1), "b"],  # tuples and values mixed
    [2**64, 1],  # beyond int64
    [("a", (1, 2))] * 2,  # nested tuples
    [("a", 1.0j)] * 2,  # complex
    [os.sep, bytearray(b"x")],  # bytearray is mutable
    [None] * 20,  # one object each: reading them copies nothing
    [True, False, None] * 10,
    list(range(-5, 257)) * 2,  # CPython's small ints
])
def test_anything_but_plain_values_is_left_alone(sequence):
    assert encode_sequence(sequence) is None


def test_a_forked_child_reads_the_parents_mapping_without_a_descriptor():
    copy_ = shared([f"/data/{i}.jpg" for i in range(100)])
    assert isinstance(copy_, SharedList)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the mapping is inherited
        os.close(read)
        os.write(write, copy_[42].encode())
        os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 100) == b"/data/42.jpg"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
