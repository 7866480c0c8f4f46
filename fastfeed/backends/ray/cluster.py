"""``worker_mode="ray"``'s options: Ray itself, the cluster this process is connected to, where
the actors go (``ray_options``), and how many of them the cluster's free resources hold.

Ray is imported only here, and only when ``worker_mode="ray"`` asks for it: fastfeed imports
and runs without it.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from fastfeed._install import install_line

__all__ = ["DEFAULT_OPTIONS", "actor_options", "cluster_workers", "connected_ray", "import_ray"]

# One CPU per worker, as a worker process takes one core.
DEFAULT_OPTIONS: dict[str, Any] = {"num_cpus": 1}

# Where an actor runs and what it needs: the options of Ray's own ``.options()`` that are the
# user's to choose. fastfeed sets the others itself: the actor's name, its lifetime (that of
# this process), no restarts or retries by Ray (the backend restarts a lost worker itself, in
# order) and one call at a time.
PLACEMENT_OPTIONS = frozenset({
    "num_cpus", "num_gpus", "memory", "resources", "accelerator_type", "label_selector",
    "scheduling_strategy", "runtime_env",
})

_CONNECT = ("worker_mode='ray' runs the workers on the Ray cluster this process is connected "
            "to, and it is connected to none: call ray.init(address=...) first (ray.init() "
            "alone starts a one-machine cluster here)")


def import_ray() -> ModuleType:
    """The ``ray`` module.

    Raises:
        ImportError: Ray is not installed; the message says how to install it.
    """
    try:
        return importlib.import_module("ray")
    except ImportError as error:
        raise ImportError(f"worker_mode='ray' needs Ray: {install_line('ray')}") from error


def connected_ray() -> ModuleType:
    """The ``ray`` module, connected to a cluster.

    Raises:
        ImportError: Ray is not installed.
        RuntimeError: no cluster is connected; the message says to call ``ray.init``.
    """
    ray = import_ray()
    if not ray.is_initialized():
        raise RuntimeError(_CONNECT)
    return ray


def actor_options(ray_options: Any) -> dict[str, Any]:
    """``ray_options`` over the defaults, checked by Ray's own validation.

    Raises:
        TypeError: ``ray_options`` is not a dict.
        ValueError: an option that fastfeed sets itself, or an unknown one; or Ray refuses a
            value.
        ImportError: Ray is not installed.
    """
    if ray_options is None:
        ray_options = {}
    if not isinstance(ray_options, dict):
        raise TypeError(f"ray_options should be a dict of Ray actor options, got "
                        f"{type(ray_options).__name__}")
    unknown = sorted(set(ray_options) - PLACEMENT_OPTIONS)
    if unknown:
        raise ValueError(f"ray_options: {', '.join(map(repr, unknown))} cannot be set here; "
                         f"the options are {', '.join(sorted(PLACEMENT_OPTIONS))} (fastfeed "
                         "names its actors and restarts a lost one itself)")
    options = {**DEFAULT_OPTIONS, **ray_options}
    ray = import_ray()
    # Ray checks each value's type and range when options are given, long before an actor
    # starts: the error comes from the loader's constructor, as DataLoader's own.
    ray.remote(_Probe).options(**options)
    return options


class _Probe:
    """A class Ray validates actor options against."""


def cluster_workers(options: dict[str, Any]) -> tuple[int, int]:
    """``(start, maximum)`` workers for ``num_workers="auto"``: the maximum is what the
    cluster's free resources hold now (the cores of this machine say nothing about the
    cluster's), and the start is where a user would begin (at most 8), within it.

    Raises:
        RuntimeError: no cluster is connected.
    """
    free = connected_ray().available_resources()
    needs = {"CPU": options.get("num_cpus", 1), "GPU": options.get("num_gpus", 0),
             "memory": options.get("memory", 0), **(options.get("resources") or {})}
    fits = [int(free.get(name, 0) // amount) for name, amount in needs.items() if amount]
    maximum = max(1, min(fits) if fits else int(free.get("CPU", 1)))
    return min(maximum, 8), maximum
