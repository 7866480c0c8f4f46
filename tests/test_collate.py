"""fastfeed.collate: collating into a slot, whatever the collate_fn; the same batch as the
collate_fn gives, with its tensors where ``empty`` put them."""

from collections import namedtuple

import numpy as np
import pytest
import torch
from helpers import assert_same

from fastfeed import _stack
from fastfeed._torch_compat import default_collate
from fastfeed.collate import as_collate_into, batch_shape, default_collate_into, gather_images

Sample = namedtuple("Sample", ["image", "label"])


class Recorder:
    """An ``empty`` that records what it hands out."""

    def __init__(self):
        self.made = []

    def __call__(self, shape, dtype):
        tensor = torch.empty(shape, dtype=dtype)
        self.made.append(tensor)
        return tensor

    def holds(self, tensor):
        return any(tensor.data_ptr() == made.data_ptr() for made in self.made)


SAMPLES = {
    "tensors": [(torch.rand(3, 4), 1), (torch.rand(3, 4), 2)],
    "dicts": [{"x": torch.arange(3), "name": "a", "v": np.float32(2)},
              {"x": torch.arange(3) + 1, "name": "b", "v": np.float32(3)}],
    "namedtuples": [Sample(torch.zeros(2), 0), Sample(torch.ones(2), 1)],
    "numpy arrays": [np.arange(4), np.arange(4) * 2],
    "mixed shapes go to torch's path": [[torch.rand(2)], [torch.rand(2)]],
}


@pytest.mark.parametrize("name", SAMPLES)
def test_default_collate_into_equals_default_collate(name):
    samples = SAMPLES[name]
    assert_same(default_collate(samples), default_collate_into(samples, Recorder()))


def test_stackable_tensors_are_stacked_into_the_memory_empty_gives():
    empty = Recorder()
    images, labels = default_collate_into([(torch.rand(3, 4), 1), (torch.rand(3, 4), 2)], empty)
    assert empty.holds(images) and images.shape == (2, 3, 4)
    assert not empty.holds(labels)  # ints become a tensor by torch's own path


def test_tensors_that_cannot_stack_fast_take_torchs_path_and_errors():
    empty = Recorder()
    batch = default_collate_into([torch.rand(2), torch.rand(2).double()], empty)
    assert batch.dtype == torch.float64 and empty.made == []  # promoted as torch does
    with pytest.raises(RuntimeError):
        default_collate_into([torch.rand(2), torch.rand(3)], empty)


class Subclass(torch.Tensor):
    pass


def odd_last(kind):
    """Four plain samples, then one the gather must not copy as bytes."""
    g = torch.Generator().manual_seed(0)
    if kind == "conj view":
        complex_ = [torch.randn(2, 3, dtype=torch.complex64, generator=g) for _ in range(5)]
        return [*complex_[:4], complex_[4].conj()]
    plain = [torch.randn(2, 3, generator=g) for _ in range(4)]
    last = torch.randn(2, 3, generator=g)
    odd = {
        "subclass": lambda: last.as_subclass(Subclass),
        "requires_grad": lambda: last.requires_grad_(),
        "neg view": lambda: torch._neg_view(last),
        "transposed": lambda: torch.randn(3, 2, generator=g).t(),
        "other shape": lambda: torch.randn(3, 2, generator=g),
        "other dtype": lambda: last.double(),
        "sparse": lambda: last.to_sparse(),
    }[kind]()
    return [*plain, odd]


@pytest.fixture(params=[False, True], ids=["own-gil", "shared-gil"])
def shares_the_gil(request):
    """Both ways of reading the lazy bits: a worker thread's (dispatch keys) and others'."""
    _stack.set_shares_the_gil(request.param)
    yield request.param
    _stack.set_shares_the_gil(False)


@pytest.mark.parametrize("kind", ["subclass", "requires_grad", "neg view", "conj view",
                                  "transposed", "other shape", "other dtype", "sparse"])
def test_one_odd_sample_among_plain_ones_gets_what_default_collate_gives(kind, shares_the_gil):
    """The fast path checks every sample, not the first: the last one decides here."""
    try:
        expected = default_collate(odd_last(kind))
    except Exception as error:
        with pytest.raises(type(error)):
            default_collate_into(odd_last(kind), Recorder())
        return
    got = default_collate_into(odd_last(kind), Recorder())
    assert type(got) is type(expected) and got.dtype == expected.dtype
    assert got.requires_grad == expected.requires_grad
    assert torch.equal(got.detach(), expected.detach())


def test_a_slot_aware_collate_is_given_empty_and_any_other_ignores_it():
    class SlotAware:
        def __call__(self, samples):
            raise AssertionError("collate_into is the slot's path")

        def collate_into(self, samples, empty):
            return empty((len(samples),), torch.int64).copy_(torch.tensor(samples))

    empty = Recorder()
    assert empty.holds(as_collate_into(SlotAware())([1, 2, 3], empty))
    plain = as_collate_into(lambda samples: sum(samples))
    assert plain([1, 2, 3], empty) == 6 and len(empty.made) == 1
    assert as_collate_into(default_collate) is default_collate_into


def test_gather_images_turns_hwc_arrays_into_nchw_with_channels_reversed_where_asked():
    images = [np.random.default_rng(i).integers(0, 255, (4, 5, 3), dtype=np.uint8)
              for i in range(3)]
    empty = Recorder()
    out = gather_images(images, empty, reverse_channels=[False, True, False])
    assert empty.holds(out) and out.shape == (3, 3, 4, 5)
    assert torch.equal(out[0], torch.from_numpy(images[0]).permute(2, 0, 1))
    assert torch.equal(out[1], torch.from_numpy(images[1][..., ::-1].copy()).permute(2, 0, 1))


def test_a_batch_of_images_must_share_one_shape():
    with pytest.raises(ValueError, match="differ in shape"):
        batch_shape([np.zeros((2, 2, 3)), np.zeros((3, 2, 3))])
    with pytest.raises(ValueError, match="empty batch"):
        batch_shape([])
