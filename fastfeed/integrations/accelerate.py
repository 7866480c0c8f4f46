"""One line for Hugging Face Accelerate: ``prepare()`` keeps (or makes) FastLoaders.

.. code-block:: python

    import fastfeed.integrations.accelerate

    fastfeed.integrations.accelerate.patch()
    loader = accelerator.prepare(FastLoader(dataset, batch_size=64, num_workers=8))

Accelerate's ``prepare()`` (which the Hugging Face ``Trainer`` calls on the loaders it builds)
rebuilds every loader as its own ``DataLoaderShard`` over a new
``torch.utils.data.DataLoader``, from the torch arguments of the loader it was given: a
FastLoader passed in is silently replaced by a stock loader. :func:`patch` makes that inner
loader a FastLoader, with Accelerate's arguments (its sharded sampler, ``collate_fn``,
workers...). A FastLoader passed in keeps its own FastLoader options (``worker_mode``,
``device``, ...); any other loader, such as the ``Trainer``'s, gets the options given to
:func:`patch`. ``skip_first_batches`` (mid-epoch resume) is covered the same way.

Accelerate is optional, and imported by :func:`patch`, never by ``import fastfeed``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from fastfeed.integrations._patching import FASTLOADER_OPTIONS, Swaps, check_options
from fastfeed.loader import FastLoader

__all__ = ["is_patched", "patch", "patched", "unpatch"]

_swaps = Swaps()
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
    check_options(fastloader_options)
    from accelerate import accelerator, data_loader

    _swaps.set(data_loader, "DataLoader", functools.partial(_inner_loader, fastloader_options))
    for name in ("prepare_data_loader", "skip_first_batches"):
        wrapped = _passing_options(_swaps.original(data_loader, name))
        for module in (data_loader, accelerator):  # accelerator.py imported the names
            _swaps.set(module, name, wrapped)


def unpatch() -> None:
    """Give Accelerate back its own loader construction."""
    _swaps.restore()


def is_patched() -> bool:
    """Whether :func:`patch` is in effect."""
    return bool(_swaps)


@contextlib.contextmanager
def patched(**fastloader_options: Any) -> Iterator[None]:
    """:func:`patch` for the duration of a ``with`` block, then :func:`unpatch`."""
    patch(**fastloader_options)
    try:
        yield
    finally:
        unpatch()


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
