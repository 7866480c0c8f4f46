"""Which backend runs a ``worker_mode``: the one place a mode's name is looked up.

Adding a backend is a module in :mod:`fastfeed.backends` whose class follows
:class:`~fastfeed.backends.interface.WorkerBackend` (its traits, its refusals, its placement)
and a line here. Everything else asks the class, never the name.
"""

from __future__ import annotations

from typing import Any

from fastfeed.backends.interface import WorkerBackend
from fastfeed.backends.process import ProcessBackend
from fastfeed.backends.ray.backend import RayBackend
from fastfeed.backends.thread import ThreadBackend

__all__ = ["AUTO", "WORKER_MODES", "backend_named", "backends_for", "checked_placement"]

_BACKENDS: dict[str, type[WorkerBackend]] = {
    backend.name: backend for backend in (ProcessBackend, ThreadBackend, RayBackend)}

# ``worker_mode="auto"``: one epoch with each of these that can run the loader, then the
# fastest; the first is the default where only one can, or the mode cannot change (persistent
# workers keep theirs).
AUTO = "auto"
_AUTO_CONTEST = (ProcessBackend, ThreadBackend)

WORKER_MODES = ("process", "thread", AUTO, "ray")


def backend_named(worker_mode: str) -> type[WorkerBackend]:
    """The backend of ``worker_mode`` (not ``"auto"``).

    Raises:
        ValueError: no backend has that name.
    """
    backend = _BACKENDS.get(worker_mode)
    if backend is None:
        raise ValueError(f"worker_mode should be one of {', '.join(map(repr, WORKER_MODES))}, "
                         f"got {worker_mode!r}")
    return backend


def backends_for(worker_mode: str, dataset: Any = None, deterministic: bool = False
               ) -> tuple[type[WorkerBackend], ...]:
    """The backends ``worker_mode`` may run a loader of ``dataset`` with: its own, or for
    ``"auto"`` those of the contest that do not refuse it (the first of them at least)."""
    if worker_mode != AUTO:
        return (backend_named(worker_mode),)
    able = tuple(b for b in _AUTO_CONTEST if b.refusal(dataset, deterministic) is None)
    return able or _AUTO_CONTEST[:1]


def checked_placement(worker_mode: str, dataset: Any, deterministic: bool,
                      ray_options: dict[str, Any] | None) -> dict[str, Any] | None:
    """Check that ``worker_mode``'s backends can run this loader; return their placement of
    the workers (``ray_options`` checked), None where they take none.

    Raises:
        ValueError, TypeError: a backend refuses the loader or the options.
        ImportError: the backend needs a library that is not installed.
    """
    backends = backends_for(worker_mode, dataset, deterministic)
    if worker_mode != AUTO:  # "auto" takes whichever of its contest can run the loader
        why = backends[0].refusal(dataset, deterministic)
        if why is not None:
            raise ValueError(why)
    return backends[0].placement(ray_options)
