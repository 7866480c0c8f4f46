"""FastLoader is a DataLoader: arguments, defaults, validation, attributes, rebuilding."""

import inspect
import warnings

import pytest
import torch
from helpers import assert_same
from sample_datasets import ShardedIterable, TensorDataset
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from fastfeed import FastLoader


def test_is_a_dataloader():
    assert isinstance(FastLoader(TensorDataset()), DataLoader)


def test_signature_extends_torch_without_clashing():
    ours = inspect.signature(FastLoader.__init__).parameters
    theirs = inspect.signature(DataLoader.__init__).parameters
    for name, param in theirs.items():
        assert name in ours, name
        assert (ours[name].default, ours[name].kind) == (param.default, param.kind), name
    extra = [p for name, p in ours.items() if name not in theirs]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)


BAD_ARGUMENTS = [
    {"num_workers": -1},
    {"timeout": -1},
    {"prefetch_factor": 2},
    {"num_workers": 2, "prefetch_factor": -1},
    {"persistent_workers": True},
    {"shuffle": True, "sampler": RandomSampler(range(4))},
    {"batch_sampler": [[0]], "batch_size": 2},
    {"batch_sampler": [[0]], "drop_last": True},
    {"batch_size": None, "drop_last": True},
    {"multiprocessing_context": "fork"},
    {"num_workers": 2, "multiprocessing_context": "nonsense"},
    {"num_workers": 2, "multiprocessing_context": 3},
]


@pytest.mark.parametrize("kwargs", BAD_ARGUMENTS, ids=lambda k: ",".join(k))
def test_validation_matches_torch(kwargs):
    with pytest.raises(Exception) as expected:
        DataLoader(TensorDataset(), **kwargs)
    with pytest.raises(type(expected.value)) as got:
        FastLoader(TensorDataset(), **kwargs)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("kwargs", [{"shuffle": True}, {"sampler": [0]}, {"batch_sampler": [[0]]}])
def test_iterable_dataset_validation_matches_torch(kwargs):
    with pytest.raises(ValueError) as expected:
        DataLoader(ShardedIterable(), **kwargs)
    with pytest.raises(ValueError) as got:
        FastLoader(ShardedIterable(), **kwargs)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("value", [-1, 1.5, "2", True])
def test_bad_ring_slots(value):
    with pytest.raises(ValueError, match="ring_slots"):
        FastLoader(TensorDataset(), ring_slots=value)


ATTRIBUTES = ["dataset", "batch_size", "drop_last", "num_workers", "timeout", "pin_memory",
              "pin_memory_device", "generator", "collate_fn", "prefetch_factor",
              "persistent_workers", "worker_init_fn", "in_order", "multiprocessing_context"]


@pytest.mark.parametrize("kwargs", [
    {},
    {"batch_size": 5, "shuffle": True, "drop_last": True, "num_workers": 2},
    {"batch_size": None, "num_workers": 1, "prefetch_factor": 4, "persistent_workers": True},
    {"batch_sampler": [[0, 1], [2]], "num_workers": 2, "multiprocessing_context": "spawn"},
])
def test_attributes_match_torch(kwargs):
    dataset = TensorDataset()
    generator = torch.Generator()
    a = DataLoader(dataset, generator=generator, **kwargs)
    b = FastLoader(dataset, generator=generator, **kwargs)
    for name in ATTRIBUTES:
        assert getattr(a, name) == getattr(b, name), name
    assert type(a.sampler) is type(b.sampler)
    assert type(a.batch_sampler) is type(b.batch_sampler)
    assert len(a) == len(b)


def test_attribute_guard_matches_torch():
    loader = FastLoader(TensorDataset())
    for name in ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset",
                 "persistent_workers"):
        with pytest.raises(ValueError, match=f"{name} attribute should not be set after "
                                             "FastLoader is initialized"):
            setattr(loader, name, None)
    loader.num_workers = 2  # torch allows these
    loader.timeout = 1


def test_rebuild_from_attributes_with_distributed_sampler():
    # What Lightning and Accelerate do: read the constructor's arguments back from the
    # attributes, swap in a DistributedSampler, and build a new loader of the same class.
    def rebuild(loader):
        params = inspect.signature(type(loader).__init__).parameters
        kwargs = {name: getattr(loader, name) for name in params
                  if name not in ("self", "sampler", "batch_sampler", "shuffle")
                  and hasattr(loader, name)}
        kwargs["sampler"] = DistributedSampler(loader.dataset, num_replicas=2, rank=1, seed=3)
        return type(loader)(**kwargs)

    results = []
    for cls in (DataLoader, FastLoader):
        rebuilt = rebuild(cls(TensorDataset(), batch_size=4, shuffle=True, num_workers=2))
        assert type(rebuilt) is cls
        results.append(list(rebuilt))
    assert_same(results[0], results[1])


def test_pin_memory_without_cuda_warns_and_works():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour")
    caught = []
    for cls in (DataLoader, FastLoader):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            batches = list(cls(TensorDataset(), batch_size=4, num_workers=2, pin_memory=True))
        caught.append(sorted({str(w.message) for w in record if "pin_memory" in str(w.message)}))
        assert len(batches) == 10
    assert caught[0] == caught[1] and len(caught[0]) == 1


def test_len_and_iterator_len():
    loader = FastLoader(TensorDataset(n=37), batch_size=5, num_workers=2)
    iterator = iter(loader)
    assert len(loader) == len(iterator) == 8
    del iterator


def _first_batch_or_error(cls, kwargs, after):
    """(phase, error type, message) of building ``cls`` with ``kwargs``, ``after(loader)``,
    then taking a batch; ``(None, None, "")`` when it works."""
    try:
        loader = cls(TensorDataset(), **kwargs)
    except Exception as error:
        return "build", type(error), str(error)
    after(loader)
    try:
        next(iter(loader))
    except Exception as error:
        return "iterate", type(error), str(error)
    return None, None, ""


def _set_workers(loader):
    loader.num_workers = 2


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # torch's __del__
@pytest.mark.parametrize(("kwargs", "after", "same_message"), [
    ({"num_workers": "2"}, lambda loader: None, False),
    ({"num_workers": 2.0}, lambda loader: None, True),
    ({"num_workers": 2, "prefetch_factor": 0}, lambda loader: None, True),
    ({}, _set_workers, False),
], ids=["str", "float", "prefetch-0", "num_workers-set-later"])
def test_misuse_raises_torchs_error_at_the_same_step(kwargs, after, same_message):
    # torch's messages where they name the problem; clearer ones where they are incidental
    # ("'<' not supported between instances of 'str' and 'int'").
    phase, kind, message = _first_batch_or_error(DataLoader, kwargs, after)
    got_phase, got_kind, got_message = _first_batch_or_error(FastLoader, kwargs, after)
    assert (got_phase, got_kind) == (phase, kind) and kind is not None
    assert got_message == message if same_message else "num_workers" in got_message


def test_an_unpicklable_worker_init_fn_warns_as_torch_does():
    # Only the pickle warnings are counted: the block also records whatever else warns while it
    # runs, such as the finalisers of earlier tests' objects that a collection reaches there.
    def run(cls):
        loader = cls(TensorDataset(), num_workers=1, multiprocessing_context="spawn",
                     worker_init_fn=lambda worker_id: None)
        with pytest.warns(UserWarning, match="Got pickle error") as record, \
                pytest.raises(Exception) as error:
            next(iter(loader))
        return type(error.value), sum("Got pickle error" in str(w.message) for w in record)

    assert run(FastLoader) == run(DataLoader)


def test_worker_processes_are_named_as_torchs():
    loader = FastLoader(TensorDataset(), num_workers=1, persistent_workers=True)
    next(iter(loader))
    worker = loader._live_iterator()._table[0]
    with open(f"/proc/{worker.handle.pid}/comm") as comm:
        assert comm.read().strip() == "pt_data_worker"
