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

# FASTFEED_TEST_START_METHOD=forkserver runs the suite as on Python 3.14 (see
# start_method/sitecustomize.py): this interpreter, and each one it starts, defaults to it.
if os.environ.get("FASTFEED_TEST_START_METHOD"):
    _folder = str(Path(__file__).parent / "start_method")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [_folder, *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.path.insert(0, _folder)
    import sitecustomize  # noqa: F401  (this interpreter started before PYTHONPATH named it)

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
