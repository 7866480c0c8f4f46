"""Whether an optional package can be used here."""

from __future__ import annotations

import importlib

__all__ = ["importable"]


def importable(module: str) -> bool:
    """Whether ``module`` imports: installed, and built for this torch (a torchvision built
    for another torch raises at import, not ``ImportError``)."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True
