"""fastfeed.planning: each epoch's plan, made once before its host iterator."""

import dataclasses

import pytest
import torch
from sample_datasets import TensorDataset

from fastfeed import FastLoader
from fastfeed.planning import PINNED_AHEAD
from fastfeed.slots.page_lock import PageLocker


def test_slots_are_page_locked_only_when_fastfeed_owns_the_copy(monkeypatch):
    # With pin_memory=True the user drives the copy: a slot must never be handed out
    # page-locked. With device="cuda" fastfeed owns the copy and fences the slot.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    user_copies = FastLoader(TensorDataset(), batch_size=4, num_workers=2, pin_memory=True)
    plan = user_copies._plan_epoch()
    assert plan.host.slot_pool is not None and plan.host.slot_pool.pin is None
    assert plan.stage.pinned_ahead == PINNED_AHEAD and plan.stage.watches_gpu

    fastfeed_copies = FastLoader(TensorDataset(), batch_size=4, num_workers=2, device="cuda",
                                 pin_memory=True)
    fastfeed_copies._device_stage._target = torch.device("cuda", 1)
    plan = fastfeed_copies._plan_epoch()
    assert plan.host.slot_pool.pin == PageLocker(1) and plan.stage.pinned_ahead is None


def test_worker_threads_write_slots_only_where_none_is_page_locked(monkeypatch):
    # A thread's batch is handed over as made: nothing records which of its tensors view the
    # slot, so the device stage could not refuse one its copy does not reach.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_the_host = FastLoader(TensorDataset(), batch_size=4, num_workers=2, worker_mode="thread",
                             pin_memory=True)
    assert on_the_host._plan_epoch().host.slot_pool.pin is None
    to_the_device = FastLoader(TensorDataset(), batch_size=4, num_workers=2, device="cuda",
                               worker_mode="thread")
    to_the_device._device_stage._target = torch.device("cuda", 0)
    assert to_the_device._plan_epoch().host.slot_pool is None


def test_without_workers_pinning_is_in_next(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plan = FastLoader(TensorDataset(), batch_size=4, pin_memory=True)._plan_epoch()
    assert plan.stage.pinned_ahead == 0
    assert plan.host.held_batches == 0 and plan.host.times_delivery


@pytest.mark.parametrize("device", [None, "cpu"])
def test_the_device_stage_holds_its_batches_out_of_the_slot_pool(device):
    loader = FastLoader(TensorDataset(), batch_size=4, num_workers=2, device=device,
                        prefetch_depth=3)
    host = loader._plan_epoch().host
    assert host.held_batches == (4 if device else 0)
    assert host.times_delivery == (device is not None)


def test_without_workers_there_is_no_backend_nor_slot_pool():
    loader = FastLoader(TensorDataset(), batch_size=4)
    plan = loader._plan_epoch()
    assert plan.host.backend is None and plan.host.slot_pool is None
    assert loader._planner.slot_pool is None


def test_the_plan_is_frozen():
    plan = FastLoader(TensorDataset(), batch_size=4, num_workers=2)._plan_epoch()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.host = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.host.slot_cap = 3


def test_persistent_workers_carry_on_with_their_host_plan():
    loader = FastLoader(TensorDataset(n=16), batch_size=4, num_workers=2,
                        persistent_workers=True, ring_slots=5)
    plans = []
    plan_epoch = loader._plan_epoch

    def recorded(new_host=True):
        plans.append((new_host, plan_epoch(new_host)))
        return plans[-1][1]

    loader._plan_epoch = recorded
    for _ in range(3):
        list(loader)
    assert [new for new, _ in plans] == [True, False, False]
    assert plans[1][1].host is plans[0][1].host is plans[2][1].host
    assert plans[0][1].host.slot_cap == 5


def test_a_new_host_iterator_gets_a_new_host_plan():
    loader = FastLoader(TensorDataset(n=16), batch_size=4, num_workers=2)
    first, second = loader._plan_epoch(), loader._plan_epoch()
    assert first.host is not second.host
    assert first.host.slot_pool is second.host.slot_pool  # one per loader, kept across epochs


def test_the_auto_contest_runs_each_backend_for_an_epoch_then_keeps_the_faster():
    loader = FastLoader(TensorDataset(n=16), batch_size=4, num_workers=2, worker_mode="auto")
    contest = []
    for _ in range(4):
        contest.append(loader._plan_epoch().host.backend.name)
        loader._planner.carry_over.epoch_rates.setdefault(contest[-1], len(contest))
    assert contest == ["process", "thread", "thread", "thread"]
    assert any("worker_mode auto" in d for d in loader.stats().decisions)
