import os
import sys
from pathlib import Path

# Misusing a ring ticket (a double release) raises in tests instead of being logged.
os.environ["FASTFEED_STRICT_RING"] = "1"

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
