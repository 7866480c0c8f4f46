"""Where workers run, behind one protocol (:mod:`fastfeed.backends.interface`): processes (the
default; batches cross through the slot pool), threads, or Ray actors on a cluster
(:mod:`fastfeed.backends.ray`), each found by its ``worker_mode`` in
:mod:`fastfeed.backends.registry`."""

from fastfeed.backends.interface import (
    BackendArgs,
    BackendTraits,
    WorkerBackend,
    WorkerExited,
    WorkerHandle,
)
from fastfeed.backends.registry import (
    AUTO,
    WORKER_MODES,
    backend_named,
    backends_for,
    checked_placement,
)

__all__ = ["AUTO", "WORKER_MODES", "BackendArgs", "BackendTraits", "WorkerBackend",
           "WorkerExited", "WorkerHandle", "backend_named", "backends_for", "checked_placement"]
