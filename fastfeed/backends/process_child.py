"""A worker process's whole life, from the config it was started with to its exit."""

from __future__ import annotations

import gc
from typing import Any

from fastfeed import inherited_fds
from fastfeed.protocol import ShutdownFlag, WorkerConfig
from fastfeed.shared_lists import ListsHandOff, received_config
from fastfeed.slots.arena import WorkerSlots
from fastfeed.slots.control import ControlPipe
from fastfeed.worker import own_process, worker_loop

__all__ = ["run_worker"]


def run_worker(config: WorkerConfig | ListsHandOff, task_queue: Any, result_queue: Any,
               shutting_down: ShutdownFlag, control: ControlPipe | None) -> None:
    """A worker process's whole life."""
    config = received_config(config)  # first: the dataset reads its shared lists from here on
    # Forked, it closes what it inherited of the main process's loaders, and the inherited
    # objects move out of reach of its garbage collector, whose full collections would
    # otherwise write to (so copy) every page that holds one.
    inherited_fds.release_inherited(keep=(task_queue, result_queue))
    gc.freeze()
    slots = None if control is None else WorkerSlots(control)
    worker_loop(config, task_queue, result_queue, shutting_down, slots, own_process, "process")
    if shutting_down.is_set():
        # What it had left to say, nobody reads: exit without flushing it.
        result_queue.cancel_join_thread()
        result_queue.close()
