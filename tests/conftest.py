import os
import signal
import sys
from pathlib import Path

# Misusing a slot pool ticket (a double release) raises in tests instead of being logged.
os.environ["FASTFEED_STRICT_SLOTS"] = "1"

# A suite started in the background by a shell without job control (`nohup ... &`) inherits
# SIGINT ignored, and so would every Python it starts: the Ctrl-C and SIGTERM tests would then
# test nothing but that. Python's own handler, as in a terminal; children start with it too.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

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
