"""One line for timm: ``timm.data.create_loader`` builds :class:`~fastfeed.FastLoader`\\ s.

.. code-block:: python

    import fastfeed.integrations.timm

    fastfeed.integrations.timm.patch()
    loader = timm.data.create_loader(dataset, input_size=(3, 224, 224), batch_size=256,
                                     is_training=True, num_workers=8)

``create_loader`` names ``torch.utils.data.DataLoader`` when it is called (or
``MultiEpochsDataLoader`` with ``use_multi_epochs_loader=True``). :func:`patch` gives timm's
loader module a view of ``torch`` in which that name is FastLoader (the rest of torch is
untouched, for timm and for everyone else), and swaps ``MultiEpochsDataLoader`` for a subclass
with FastLoader underneath. The loader gets exactly timm's arguments: its sampler,
``fast_collate``, ``worker_init_fn`` and ``persistent_workers``; batches equal the stock
loader's. timm's ``PrefetchLoader`` (``use_prefetcher=True``, the default) stays on top with
its side-stream copy and normalisation. Without CUDA, pass ``device=torch.device("cpu")`` to
``create_loader``: its default device is ``cuda``, with or without fastfeed.

timm is optional, and imported by :func:`patch`, never by ``import fastfeed``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from fastfeed._patching import Overlay, Patch, Swaps
from fastfeed.loader import FastLoader

__all__ = ["is_patched", "patch", "patched", "unpatch"]


def patch(**fastloader_options: Any) -> None:
    r"""Make ``timm.data.create_loader`` build FastLoaders.

    Calling it again replaces the options; loaders built before keep theirs.

    Args:
        **fastloader_options: :class:`~fastfeed.FastLoader` keywords that ``DataLoader`` does
            not have, for every loader timm builds: for example ``worker_mode="thread"``.

    Raises:
        ImportError: timm is not installed.
        TypeError: an option is not a FastLoader-only keyword.
    """
    _patch.patch(**fastloader_options)


def _swap_loaders(swaps: Swaps, fastloader_options: dict[str, Any]) -> None:
    from timm.data import loader as timm_loader

    from fastfeed.integrations._timm_loaders import MultiEpochsFastLoader

    fast = partial(FastLoader, **fastloader_options)
    data = Overlay(torch.utils.data, DataLoader=fast)
    swaps.set(timm_loader, "torch", Overlay(torch, utils=Overlay(torch.utils, data=data)))
    swaps.set(timm_loader, "MultiEpochsDataLoader",
              partial(MultiEpochsFastLoader, **fastloader_options))


_patch = Patch(_swap_loaders)
unpatch, is_patched, patched = _patch.unpatch, _patch.is_patched, _patch.patched
