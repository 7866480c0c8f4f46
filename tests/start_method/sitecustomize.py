"""Sets the default start method of every interpreter the test suite starts, before any of its
code runs, when ``FASTFEED_TEST_START_METHOD`` names one: ``forkserver`` models Python 3.14 on
Linux, whose default it is (and torch's DataLoader follows the default when
``multiprocessing_context`` is None). ``tests/conftest.py`` puts this folder on ``PYTHONPATH``,
so the scripts, workers and fresh interpreters the tests start get the same default.

Python 3.14's forkserver imports the main module once, and with it what a training script
imports (torch, fastfeed), so its workers start without importing them. Python 3.11 to 3.13.0
never give the server the main module's path (CPython issue 126631, fixed in 3.14), so each
worker would import both afresh: 5.5 s for a bare worker at load 4 here, 0.03 s with torch
preloaded; fastfeed's import (no bytecode cache under PYTHONDONTWRITEBYTECODE) took a churn of
abandoned iterators from 0.03 s to 0.32 s each. The server preloads both here, as 3.14's would.
"""

import os

_method = os.environ.get("FASTFEED_TEST_START_METHOD")
if _method:
    import multiprocessing

    multiprocessing.set_start_method(_method, force=True)
    if _method == "forkserver":
        multiprocessing.set_forkserver_preload(["__main__", "torch", "fastfeed"])
