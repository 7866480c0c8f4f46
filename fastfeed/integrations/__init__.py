"""One reversible line for frameworks that build their own loaders.

Some frameworks never hand the user's loader to the training loop: they build one themselves,
from ``torch.utils.data.DataLoader``. Each module here makes one of them build a
:class:`~fastfeed.FastLoader` instead, with the arguments it would have given the stock loader:

- :mod:`fastfeed.integrations.timm`: ``timm.data.create_loader`` (and timm's ``train.py``).
- :mod:`fastfeed.integrations.hf_accelerate`: Hugging Face Accelerate's ``prepare()`` (and so
  the Hugging Face ``Trainer``).

Each has ``patch(**fastloader_options)``, ``unpatch()``, ``is_patched()`` and a ``patched()``
context manager (from :class:`fastfeed._patching.Patch`). Importing :mod:`fastfeed` imports none
of the frameworks; ``patch()`` does. Ultralytics has its own module, :mod:`fastfeed.ultralytics`.
"""
