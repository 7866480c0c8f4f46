"""The task book and the worker table, without processes: dispatch order, delivery order,
cancellation, the resume position and what each worker owes."""

from types import SimpleNamespace

import pytest

from fastfeed.iterators.tasks import TaskBook, TaskState
from fastfeed.iterators.workers import WorkerState, WorkerTable


def send(book, workers):
    return [book.send(worker_id, ticket=f"t{i}") for i, worker_id in enumerate(workers)]


def test_in_order_delivery_waits_for_the_next_task_in_sampler_order():
    book = TaskBook()
    send(book, [0, 1, 0, 1])
    book.answer(1).result = "b1"
    assert book.deliver(in_order=True) is None  # task 0 is still in flight
    book.answer(0).result = "b0"
    assert [book.deliver(True).result, book.deliver(True).result] == ["b0", "b1"]
    assert book.deliver(True) is None and not book.finished
    book.answer(3)
    book.answer(2)
    assert [book.deliver(True).seq, book.deliver(True).seq] == [2, 3]
    assert book.finished


def test_out_of_order_delivery_follows_arrival():
    book = TaskBook()
    send(book, [0, 1, 0])
    for seq in (2, 0, 1):
        book.answer(seq)
    assert [book.deliver(in_order=False).seq for _ in range(3)] == [2, 0, 1]
    assert book.finished


def test_outstanding_work_is_counted_per_worker_from_the_tasks():
    book = TaskBook()
    send(book, [0, 1, 0])
    assert (book.outstanding(), book.outstanding(0), book.outstanding(1)) == (3, 2, 1)
    book.answer(0)
    assert (book.outstanding(), book.outstanding(0)) == (2, 1)
    book.deliver(True)
    assert book.outstanding() == 2  # delivery changes nothing a worker owes


def test_a_task_is_answered_once():
    book = TaskBook()
    send(book, [0])
    book.answer(0)
    with pytest.raises(AssertionError):
        book.answer(0)


def test_an_ended_replica_cancels_the_tasks_queued_behind_it():
    book = TaskBook()
    send(book, [0, 1, 0, 1, 0])
    book.answer(0)
    cancelled = book.cancel_worker(0)  # its replica ended at task 2: tasks 2 and 4 never run
    assert [e.seq for e in cancelled] == [2, 4]
    assert all(e.state is TaskState.CANCELLED for e in cancelled)
    assert [e.take_ticket() for e in cancelled] == ["t2", "t4"]
    assert book.outstanding(0) == 0 and book.outstanding() == 2
    book.answer(1)
    book.answer(3)
    assert [book.deliver(True).seq for _ in range(3)] == [0, 1, 3]  # cancelled ones skipped
    assert book.finished


def test_a_ticket_is_handed_over_once():
    book = TaskBook()
    send(book, [0, 1])
    entry = book.answer(0)
    assert entry.take_ticket() == "t0" and entry.take_ticket() is None
    assert book.take_tickets() == ["t1"]  # shutdown takes only what tasks still hold
    assert book.take_tickets() == []


def test_the_resume_position_is_the_next_pending_task():
    book = TaskBook()
    send(book, [0, 1, 2])
    assert book.upcoming() == (0, 0)
    book.answer(0)
    book.deliver(True)
    book.cancel_worker(1)
    assert book.upcoming() == (2, 2)  # task 1 was cancelled: worker 2's batch comes next
    book.answer(2)
    book.deliver(True)
    assert book.upcoming() == (3, None)  # nothing pending: the next task is not sent yet


def test_a_new_epoch_starts_from_nothing():
    book = TaskBook()
    send(book, [0, 1])
    book.start_epoch()
    assert book.outstanding() == 0 and book.finished and book.send(1, None) == 0


def handle(worker_id):
    return SimpleNamespace(worker_id=worker_id, task_id=100 + worker_id)


def table_of(count):
    book = TaskBook()
    table = WorkerTable(book)
    for worker_id in range(count):
        table.add(handle(worker_id))
    return book, table


def test_a_retiring_worker_may_stop_only_once_it_owes_nothing():
    book, table = table_of(2)
    send(book, [1, 1])
    assert not table.retire(1)  # two tasks still to answer
    assert table.serving == 1 and table.newest_serving() == 0
    assert table.retiring_with_tasks()
    book.answer(0)
    assert not table.may_stop(1)
    book.answer(1)
    assert table.may_stop(1) and not table.retiring_with_tasks()
    table.stop(1)
    assert table[1].state is WorkerState.STOPPED
    assert table.active_tasks() == [100]  # the sleep meter reads active workers only


def test_a_worker_that_owes_answers_cannot_stop_or_be_exhausted():
    book, table = table_of(1)
    send(book, [0])
    with pytest.raises(AssertionError):
        table.stop(0)
    with pytest.raises(AssertionError):
        table.exhaust(0, at=0)
    book.cancel_worker(0)
    table.exhaust(0, at=0)
    assert table.resumable() == [0] and table.active_count() == 0
    table.resume(0)
    assert table[0].state is WorkerState.ACTIVE and table[0].exhausted_at is None


def test_stopped_workers_hear_of_no_more_slots():
    _, table = table_of(2)
    table.stop(0)
    assert [w.handle.worker_id for w in table.mapping_slots()] == [1]
    assert table.resumable() == [1]


def test_dispatch_goes_round_robin_over_active_workers():
    _, table = table_of(3)
    table.exhaust(1, at=0)
    picks = [table.pick(None) for _ in range(4)]
    assert picks == [0, 2, 0, 2]  # the exhausted replica gets nothing, order kept


def test_out_of_order_dispatch_gives_a_worker_only_its_share():
    book, table = table_of(2)
    for _ in range(2):  # worker 0 owes its share of 4 tasks in flight
        book.send(0, None)
    assert [table.pick(4) for _ in range(2)] == [1, 1]
    book.send(1, None)
    book.send(1, None)
    assert table.pick(4) is None  # everyone owes their share: wait for an answer
    book.answer(0)
    assert table.pick(4) == 0
