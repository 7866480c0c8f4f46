"""fastfeed: a drop-in ``torch.utils.data.DataLoader`` that keeps the GPU fed.

Change one import::

    from fastfeed import FastLoader as DataLoader
"""

from fastfeed.loader import FastLoader
from fastfeed.skip import SKIP
from fastfeed.telemetry import LoaderStats
from fastfeed.worker import worker_info

__version__ = "0.1.0"

__all__ = ["SKIP", "FastLoader", "LoaderStats", "__version__", "worker_info"]
