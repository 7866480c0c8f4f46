"""fastfeed.codec: a batch to a message and back, over a slot (invariant 3: any batch structure;
fixed-size leaves in the slot, the rest pickled, both giving the same batch)."""

import dataclasses
import pickle
from collections import namedtuple

import numpy as np
import pytest
import torch
from helpers import assert_same

from fastfeed.codec import decode, encode, slot_bytes_needed
from fastfeed.slots import Lease
from fastfeed.slots.arena import Arena

Pair = namedtuple("Pair", ["image", "label"])


@dataclasses.dataclass
class Record:
    pixels: torch.Tensor
    name: str


def slot(nbytes=1 << 16):
    """A slot's memory as the worker (an arena) and the main process (a lease) see it."""
    memory = np.zeros(nbytes, np.uint8)
    return Arena(0, torch.from_numpy(memory)), memory


def round_trip(batch, nbytes=1 << 16):
    arena, memory = slot(nbytes)
    lease = Lease(memory)
    message = encode(batch, arena)
    return decode(pickle.loads(pickle.dumps(message)), lease), message, lease, memory


def inside(memory, value):
    address = (value.data_ptr() if isinstance(value, torch.Tensor)
               else value.__array_interface__["data"][0])
    start = memory.__array_interface__["data"][0]
    return start <= address < start + memory.nbytes


BATCHES = {
    "tensor": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),
    "nested": {"images": torch.ones(2, 3), "meta": [np.arange(4), ("a", 1, 2.5, None)]},
    "namedtuple": Pair(torch.zeros(2, 2, dtype=torch.uint8), torch.tensor([1, 2])),
    "dataclass": Record(torch.full((3,), 7.0), "x"),
    "strings and numbers": ["file.jpg", 3, 4.5, True],
    "non-contiguous": torch.arange(30).reshape(5, 6).t(),
    "fortran array": np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4)),
    "zero-size": torch.empty(0, 3),
    "bool and half": (torch.tensor([True, False]), torch.ones(3, dtype=torch.float16)),
}


@pytest.mark.parametrize("name", BATCHES)
def test_any_batch_structure_comes_back_the_same(name):
    batch = BATCHES[name]
    got, _, _, _ = round_trip(batch)
    assert type(got) is type(batch)
    if dataclasses.is_dataclass(batch):
        batch, got = dataclasses.astuple(batch), dataclasses.astuple(got)
    assert_same(batch, got)


def test_fixed_size_leaves_are_views_of_the_slot_and_the_lease_records_them():
    batch = {"image": torch.rand(4, 3, 8, 8), "mask": np.ones((4, 8), np.uint8), "id": "abc"}
    got, message, lease, memory = round_trip(batch)
    assert inside(memory, got["image"]) and inside(memory, got["mask"])
    assert len(lease.views) == 2
    assert len(message.payload) < 1024  # the message carries the structure, not the data


def test_views_of_one_storage_still_share_it():
    base = torch.arange(16.0)
    got, _, _, _ = round_trip((base, base[4:8], base.view(4, 4)))
    got[0][5] = -1.0
    assert got[1][1] == -1.0 and got[2][1, 1] == -1.0


def test_a_batch_larger_than_its_slot_is_pickled_and_counts_what_it_needs():
    batch = torch.rand(64, 64)
    got, message, lease, memory = round_trip(batch, nbytes=4096)
    assert_same(batch, got)
    assert not inside(memory, got) and lease.views == ()
    assert message.required >= batch.nbytes  # the slot pool grows to fit the next ones


def test_a_slot_of_the_bytes_needed_holds_every_leaf():
    batch = {"a": torch.rand(5, 7), "b": np.arange(9, dtype=np.int64), "c": [torch.ones(3)]}
    needed = slot_bytes_needed(batch)
    got, message, lease, memory = round_trip(batch, nbytes=needed)
    assert 0 < message.required <= needed
    assert len(lease.views) == 3 and all(inside(memory, view) for view in lease.views)
    assert_same(batch, got)
