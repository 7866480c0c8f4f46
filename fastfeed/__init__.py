"""fastfeed: a drop-in ``torch.utils.data.DataLoader`` that keeps the GPU fed.

Change one import::

    from fastfeed import FastLoader as DataLoader

The integrations are attributes of the package, imported on first use (so that
``import fastfeed`` imports neither torchvision nor Ultralytics)::

    import fastfeed

    train = fastfeed.vision.accelerate(train)
    fastfeed.ultralytics.patch()
"""

import importlib
from typing import TYPE_CHECKING, Any

from fastfeed.loader import FastLoader
from fastfeed.skip import SKIP
from fastfeed.stats import LoaderStats
from fastfeed.worker import worker_info

__version__ = "0.1.0"

__all__ = ["SKIP", "FastLoader", "LoaderStats", "__version__", "worker_info"]

# Subpackages reached as attributes: each is imported when first named.
_LAZY = ("backends", "bench", "doctor", "integrations", "transforms", "ultralytics", "vision")

# Hidden from type checkers, which would take every name the package lacks for one it has
# (they see the subpackages where they are imported).
if not TYPE_CHECKING:
    def __getattr__(name: str) -> Any:
        if name in _LAZY:
            # importing a submodule binds it on the package: later lookups do not come here
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
