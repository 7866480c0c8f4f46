"""Loaders that frameworks copy, rebuild or subclass behave as the stock loader does.

Lightning rebuilds a loader from ``vars(loader)`` and the constructor's signature (to swap in a
DistributedSampler), ``ddp_spawn`` pickles it to the ranks, ``copy.deepcopy`` copies it, and
litdata's StreamingDataLoader sets attributes before calling ``DataLoader.__init__``.
Streaming datasets give their ``state_dict`` arguments that belong to their own loaders.
"""

import copy
import inspect
import pickle

import pytest
import torch
from helpers import assert_same, run_epochs
from sample_datasets import ShardedIterable, StatefulIterable, TensorDataset
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from fastfeed import FastLoader


def rebuild_from_attributes(loader, **overrides):
    """What Lightning's ``_update_dataloader`` does to a loader built outside its hooks."""
    attrs = {k: v for k, v in vars(loader).items() if not k.startswith("_")}
    attrs["multiprocessing_context"] = loader.multiprocessing_context
    if type(loader.batch_sampler) is BatchSampler:  # the default one: rebuilt from batch_size
        attrs.pop("batch_sampler")
    parameters = inspect.signature(type(loader).__init__).parameters
    kwargs = {name: attrs[name] for name in parameters if name in attrs}
    kwargs.update(overrides)
    return type(loader)(**kwargs)


@pytest.mark.parametrize("workers", [0, 2])
def test_rebuilt_from_its_attributes_like_lightning(workers):
    def build(cls):
        original = cls(TensorDataset(n=24), batch_size=4, num_workers=workers,
                       persistent_workers=workers > 0)
        dataset = original.dataset
        return rebuild_from_attributes(original, sampler=SequentialSampler(dataset))

    stock, fast = build(DataLoader), build(FastLoader)
    assert fast.num_workers == stock.num_workers == workers
    assert_same(run_epochs(stock, 2, seed=0), run_epochs(fast, 2, seed=0))


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
@pytest.mark.parametrize("used", [False, True], ids=["fresh", "after-an-epoch"])
def test_pickled_or_copied_loaders_behave_like_the_original(how, used):
    def clone(loader):
        return pickle.loads(pickle.dumps(loader)) if how == "pickle" else copy.deepcopy(loader)

    kwargs = {"batch_size": 4, "num_workers": 2, "shuffle": True, "persistent_workers": used}
    stock = clone(DataLoader(TensorDataset(n=24), **kwargs))
    original = FastLoader(TensorDataset(n=24), **kwargs)
    if used:  # telemetry, the slot pool and the iterator of its persistent workers exist now
        list(original)
    fast = clone(original)
    assert type(fast) is FastLoader and fast._planner.slot_pool is None
    assert fast.stats().batches == 0
    assert_same(run_epochs(stock, 2, seed=1), run_epochs(fast, 2, seed=1))


def make_subclass(base):
    class EpochLoader(base):
        """Sets attributes before the base's __init__, as litdata's StreamingDataLoader does."""

        def __init__(self, dataset, num_workers=2, **kwargs):
            self.current_epoch = 0
            self.num_workers = num_workers
            super().__init__(dataset, num_workers=num_workers, **kwargs)

        def __iter__(self):
            self.current_epoch += 1
            return super().__iter__()

    return EpochLoader


def test_subclasses_may_set_attributes_before_init():
    stock = make_subclass(DataLoader)(TensorDataset(n=20), batch_size=4)
    fast = make_subclass(FastLoader)(TensorDataset(n=20), batch_size=4)
    assert_same(run_epochs(stock, 2, seed=0), run_epochs(fast, 2, seed=0))
    assert fast.current_epoch == 2


class ForeignStateIterable(ShardedIterable):
    """A streaming-library dataset: its state_dict takes its loader's arguments."""

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict:
        raise AssertionError("fastfeed called a state_dict that is not its to call")

    def load_state_dict(self, state: dict) -> None:
        raise AssertionError("fastfeed loaded a state it cannot have made")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_dict_with_arguments_is_never_called_and_resume_rereads(workers):
    torch.manual_seed(0)
    expected = list(DataLoader(ForeignStateIterable(), batch_size=3, num_workers=workers))
    torch.manual_seed(0)
    loader = FastLoader(ForeignStateIterable(), batch_size=3, num_workers=workers)
    iterator = iter(loader)
    head = [next(iterator) for _ in range(3)]
    state = loader.state_dict()
    del iterator
    resumed = FastLoader(ForeignStateIterable(), batch_size=3, num_workers=workers)
    resumed.load_state_dict(state)
    assert_same(expected, head + list(resumed))


def test_a_zero_argument_state_dict_is_still_the_resume_protocol():
    loader = FastLoader(StatefulIterable(), batch_size=2, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    assert loader.state_dict()["dataset_states"] is not None


def test_iterable_datasets_need_not_define_state_dict():
    class Plain(IterableDataset):
        def __iter__(self):
            return iter(torch.arange(6))

    assert_same(list(DataLoader(Plain(), batch_size=2)), list(FastLoader(Plain(), batch_size=2)))
