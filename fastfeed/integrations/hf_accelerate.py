"""One line for Hugging Face Accelerate: ``prepare()`` keeps (or makes) FastLoaders.

.. code-block:: python

    import fastfeed.integrations.hf_accelerate

    fastfeed.integrations.hf_accelerate.patch()
    loader = accelerator.prepare(FastLoader(dataset, batch_size=64, num_workers=8))

Accelerate's ``prepare()`` (which the Hugging Face ``Trainer`` calls on the loaders it builds)
rebuilds every loader as its own ``DataLoaderShard`` over a new
``torch.utils.data.DataLoader``, from the torch arguments of the loader it was given: a
FastLoader passed in is silently replaced by a stock loader. :func:`patch` makes that inner
loader a FastLoader, with Accelerate's arguments (its sharded sampler, ``collate_fn``,
workers...). A FastLoader passed in keeps its own FastLoader options (``worker_mode``,
``device``, ...); any other loader, such as the ``Trainer``'s, gets the options given to
:func:`patch`. ``skip_first_batches`` (mid-epoch resume) is covered the same way.

Accelerate is optional, and imported by :func:`patch`, never by ``import fastfeed``. (The
module was ``fastfeed.integrations.accelerate``, a name that in fastfeed means
:func:`fastfeed.vision.accelerate`; that import still works, with a ``DeprecationWarning``.)
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

from fastfeed._patching import FASTLOADER_OPTIONS, Patch, Swaps
from fastfeed.loader import FastLoader

__all__ = ["is_patched", "patch", "patched", "unpatch"]

# The FastLoader options of the loader being prepared, while Accelerate rebuilds it.
_given_options: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "fastfeed_accelerate_options", default=None)


def patch(**fastloader_options: Any) -> None:
    r"""Make Accelerate build its loaders over FastLoader.

    Calling it again replaces the options; loaders prepared before keep theirs.

    Args:
        **fastloader_options: :class:`~fastfeed.FastLoader` keywords that ``DataLoader`` does
            not have, for the loaders Accelerate rebuilds from a loader that is not a
            FastLoader (a FastLoader keeps its own).

    Raises:
        ImportError: Accelerate is not installed.
        TypeError: an option is not a FastLoader-only keyword.
    """
    _patch.patch(**fastloader_options)


def _swap_loaders(swaps: Swaps, fastloader_options: dict[str, Any]) -> None:
    from accelerate import accelerator, data_loader

    swaps.set(data_loader, "DataLoader", functools.partial(_inner_loader, fastloader_options))
    for name in ("prepare_data_loader", "skip_first_batches"):
        wrapped = _passing_options(swaps.original(data_loader, name))
        for module in (data_loader, accelerator):  # accelerator.py imported the names
            swaps.set(module, name, wrapped)


_patch = Patch(_swap_loaders)
unpatch, is_patched, patched = _patch.unpatch, _patch.is_patched, _patch.patched


def _options_of(loader: Any) -> dict[str, Any] | None:
    """The FastLoader options of ``loader`` (or of the FastLoader that Accelerate wraps)."""
    if not isinstance(loader, FastLoader):  # Accelerate's wrappers report their base's class
        return None
    options = {name: getattr(loader, name) for name in FASTLOADER_OPTIONS}
    if loader.autotune:
        options["num_workers"] = "auto"
    return options


def _passing_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function(loader, ...)`` with ``loader``'s FastLoader options visible to
    :func:`_inner_loader` while it runs."""

    @functools.wraps(function)
    def with_options(dataloader: Any, *args: Any, **kwargs: Any) -> Any:
        token = _given_options.set(_options_of(dataloader))
        try:
            return function(dataloader, *args, **kwargs)
        finally:
            _given_options.reset(token)

    return with_options


def _inner_loader(patch_options: dict[str, Any], dataset: Any, **kwargs: Any) -> DataLoader:
    """What Accelerate's ``DataLoader(dataset, **kwargs)`` builds once patched."""
    given = _given_options.get()
    return FastLoader(dataset, **{**kwargs, **(patch_options if given is None else given)})
