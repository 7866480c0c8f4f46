"""Resume mid-epoch: the rest of the epoch and later epochs equal an uninterrupted run."""

import pickle

import pytest
import torch
from helpers import assert_same
from sample_datasets import ShardedIterable, StatefulIterable, TensorDataset
from torch.utils.data import BatchSampler, RandomSampler

from fastfeed import FastLoader


def uninterrupted(build, epochs):
    loader = build()
    return [list(loader) for _ in range(epochs)]


def interrupted(build, stop_after, epochs, rebuild=None, epochs_before=0):
    """Run ``epochs_before`` epochs and ``stop_after`` batches, snapshot (through pickle),
    resume in a new loader."""
    first = build()
    done = [list(first) for _ in range(epochs_before)]
    head, iterator = [], iter(first)
    for _ in range(stop_after):
        head.append(next(iterator))
    state = pickle.loads(pickle.dumps(first.state_dict()))
    del iterator, first
    resumed = (rebuild or build)()
    resumed.load_state_dict(state)
    current = head + list(resumed)
    return [*done, current, *(list(resumed) for _ in range(epochs - epochs_before - 1))]


def map_loader(num_workers=2, persistent=False, device=None, seed=7):
    def build():
        return FastLoader(TensorDataset(n=45), batch_size=4, shuffle=True,
                          num_workers=num_workers, persistent_workers=persistent,
                          generator=torch.Generator().manual_seed(seed), device=device)
    return build


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("stop_after", [0, 1, 5, 11])
def test_map_style_resume_is_exact(num_workers, persistent, stop_after):
    if persistent and num_workers == 0:
        pytest.skip("persistent_workers needs workers")
    build = map_loader(num_workers, persistent)
    assert_same(uninterrupted(build, 3), interrupted(build, stop_after, 3))


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("epoch, stop_after", [(1, 2), (2, 0), (2, 3), (1, 6)])
def test_a_snapshot_of_a_later_epoch_resumes_exactly(persistent, epoch, stop_after):
    # Later epochs of a persistent iterator draw no worker seed; the first epoch does. A
    # snapshot must say which, or the resumed sampler draws one step off.
    build = map_loader(persistent=persistent)
    expected = uninterrupted(build, 4)
    first = build()
    done = [list(first) for _ in range(epoch)]
    iterator, head = iter(first), []
    for _ in range(stop_after):
        head.append(next(iterator))
    state = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = build()
    resumed.load_state_dict(state)
    got = done + [head + list(resumed)] + [list(resumed) for _ in range(3 - epoch)]
    assert_same(expected, got)


def test_loading_a_state_into_a_loader_with_running_workers():
    build = map_loader(persistent=True)
    expected = uninterrupted(build, 3)
    first = build()
    done = [list(first)]
    iterator = iter(first)
    head = [next(iterator), next(iterator)]
    state = first.state_dict()
    live = build()
    list(live)  # its persistent workers run, and its generator has moved on
    live.load_state_dict(state)
    assert_same(expected, [*done, head + list(live), list(live)])


def test_a_mid_epoch_snapshot_out_of_order_is_refused():
    loader = FastLoader(TensorDataset(n=40), batch_size=4, num_workers=2, in_order=False)
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(RuntimeError, match="needs in_order=True"):
        loader.state_dict()
    for _ in iterator:
        pass
    loader.state_dict()  # at the epoch's end: nothing out of order to record


@pytest.mark.parametrize("via", ["sampler", "batch_sampler"])
def test_a_samplers_own_generator_is_part_of_the_state(via):
    def build():
        sampler = RandomSampler(range(20), generator=torch.Generator().manual_seed(0))
        order = ({"sampler": sampler, "batch_size": 4} if via == "sampler"
                 else {"batch_sampler": BatchSampler(sampler, 4, drop_last=False)})
        return FastLoader(TensorDataset(n=20), num_workers=2, **order)

    assert_same(uninterrupted(build, 3), interrupted(build, 2, 3, epochs_before=1))


def test_resume_with_a_different_worker_count():
    assert_same(uninterrupted(map_loader(2), 2),
                interrupted(map_loader(2), 4, 2, rebuild=map_loader(0)))


def test_resume_on_the_device_path_counts_only_delivered_batches():
    build = map_loader(2, device="cpu")
    assert_same(uninterrupted(build, 2), interrupted(build, 3, 2))


def test_resume_without_generator_uses_the_global_rng():
    def build():
        return FastLoader(TensorDataset(n=30), batch_size=4, shuffle=True, num_workers=2)

    torch.manual_seed(3)
    expected = uninterrupted(build, 2)
    torch.manual_seed(3)
    got = interrupted(build, 2, 2)
    assert_same(expected, got)


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
@pytest.mark.parametrize("stop_after", [1, 4, 9])
def test_iterable_dataset_with_state_resumes_exactly(num_workers, stop_after):
    def build():
        return FastLoader(StatefulIterable(), batch_size=3, num_workers=num_workers)

    assert_same(uninterrupted(build, 2), interrupted(build, stop_after, 2))


def test_iterable_dataset_without_state_resumes_by_rereading():
    def build():
        return FastLoader(ShardedIterable(), batch_size=3, num_workers=2)

    torch.manual_seed(0)
    expected = uninterrupted(build, 1)
    torch.manual_seed(0)
    assert_same(expected, interrupted(build, 3, 1))


def test_state_is_small_and_at_epoch_end_starts_the_next_epoch():
    loader = map_loader(2)()
    list(loader)
    state = loader.state_dict()
    assert state["batches_yielded"] == 0
    assert len(pickle.dumps(state)) < 16_384
    fresh = map_loader(2)()
    list(fresh)
    resumed = map_loader(2)()
    resumed.load_state_dict(state)
    assert_same(list(fresh), list(resumed))


def test_bad_states_are_refused():
    loader = map_loader(2)()
    with pytest.raises(ValueError, match="not a fastfeed loader state"):
        loader.load_state_dict({"batches_yielded": 3})
    state = map_loader(2)().state_dict()
    state["batches_yielded"] = 1000
    loader.load_state_dict(state)
    with pytest.raises(ValueError, match="this epoch has only 12"):
        iter(loader)
    no_generator = FastLoader(TensorDataset(), batch_size=4)
    no_generator.load_state_dict(map_loader(0)().state_dict())
    with pytest.raises(ValueError, match="with a generator"):
        iter(no_generator)


def test_replica_count_must_match_for_iterable_state():
    first = FastLoader(StatefulIterable(), batch_size=3, num_workers=2)
    iterator = iter(first)
    next(iterator), next(iterator)
    state = first.state_dict()
    del iterator
    other = FastLoader(StatefulIterable(), batch_size=3, num_workers=3)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="same num_workers"):
        iter(other)
