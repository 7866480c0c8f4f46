"""Deprecated: the Hugging Face Accelerate integration is now
:mod:`fastfeed.integrations.hf_accelerate`.

In fastfeed, ``accelerate`` names :func:`fastfeed.vision.accelerate` (the torchvision speed-up);
this module keeps the integration's old import path working, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings

from fastfeed.integrations.hf_accelerate import is_patched, patch, patched, unpatch

__all__ = ["is_patched", "patch", "patched", "unpatch"]

warnings.warn("fastfeed.integrations.accelerate is deprecated and will be removed: import "
              "fastfeed.integrations.hf_accelerate, which has the same functions",
              DeprecationWarning, stacklevel=2)
