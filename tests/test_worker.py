"""fastfeed.worker: the worker loop, run here in a thread with plain queues (a process worker
runs the same loop with multiprocessing's)."""

import dataclasses
import queue
import threading

import torch
from test_produce import Counting, SkipsOdd, config

from fastfeed.protocol import (
    Answer,
    EpochStarted,
    Failed,
    Produced,
    ReplicaEnded,
    ShutdownFlag,
    StartEpoch,
    Stop,
    Task,
)
from fastfeed.worker import worker_loop


class Breaks(SkipsOdd):
    def __getitem__(self, i):
        if i == 3:
            raise KeyError("no sample 3")
        return super().__getitem__(i)


def run(cfg, messages, flag=None):
    """Run the loop over ``messages`` (then Stop); return its answers, in order."""
    tasks, results = queue.Queue(), queue.Queue()
    for message in [*messages, Stop()]:
        tasks.put(message)
    thread = threading.Thread(target=worker_loop, args=(
        cfg, tasks, results, flag or ShutdownFlag(), None, lambda _: None, "thread"))
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the loop did not leave on Stop"
    answers = []
    while not results.empty():
        answers.append(results.get())
    return answers


def test_each_task_is_answered_in_order_with_its_batch():
    answers = run(config(SkipsOdd()), [Task(0, [0, 2], None), Task(1, [4], None)])
    assert [a.seq for a in answers] == [0, 1]
    assert all(isinstance(a.outcome, Produced) for a in answers)
    assert answers[0].outcome.batch.tolist() == [0, 2]


def test_a_failing_sample_fails_its_task_only():
    answers = run(config(Breaks()), [Task(0, [2, 3], None), Task(1, [4], None)])
    failed, produced = answers[0].outcome, answers[1].outcome
    assert isinstance(failed, Failed) and failed.error.exc_type is KeyError
    assert failed.error.where == "in DataLoader worker thread 0"
    assert torch.equal(produced.batch, torch.tensor([4]))


def test_a_worker_init_fn_error_answers_every_task():
    def broken_init(worker_id):
        raise ValueError("init failed")

    cfg = dataclasses.replace(config(SkipsOdd()), worker_init_fn=broken_init)
    answers = run(cfg, [Task(0, [0], None), Task(1, [2], None)])
    assert [type(a.outcome) for a in answers] == [Failed, Failed]
    assert all(a.outcome.error.exc_type is ValueError for a in answers)


def test_once_shutting_down_queued_tasks_are_skipped():
    flag = ShutdownFlag()
    flag.set()
    assert run(config(SkipsOdd()), [Task(0, [0], None), Task(1, [2], None)], flag) == []


def test_an_exhausted_replica_ends_and_skips_its_tasks_until_the_next_epoch():
    answers = run(config(Counting(n=1), iterable=True), [
        Task(0, [None], None), Task(1, [None], None), Task(2, [None], None),
        StartEpoch(1, dataset_state={"position": 0}), Task(3, [None], None)])
    kinds = [(type(a), getattr(a, "seq", None)) for a in answers]
    assert kinds == [(Answer, 0), (Answer, 1), (EpochStarted, None), (Answer, 3)]
    assert isinstance(answers[1].outcome, ReplicaEnded)
    assert answers[3].outcome.batch.tolist() == [0]


def test_a_map_style_stop_iteration_is_an_error_not_the_end_of_a_replica():
    class Stops(SkipsOdd):
        def __getitem__(self, i):
            raise StopIteration

    (answer,) = run(config(Stops()), [Task(0, [0], None)])
    assert isinstance(answer.outcome, Failed)
