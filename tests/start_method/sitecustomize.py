"""Sets the default start method of every interpreter the test suite starts, before any of its
code runs, when ``FASTFEED_TEST_START_METHOD`` names one: ``forkserver`` models Python 3.14 on
Linux, whose default it is (and torch's DataLoader follows the default when
``multiprocessing_context`` is None). ``tests/conftest.py`` puts this folder on ``PYTHONPATH``,
so the scripts, workers and fresh interpreters the tests start get the same default."""

import os

_method = os.environ.get("FASTFEED_TEST_START_METHOD")
if _method:
    import multiprocessing

    multiprocessing.set_start_method(_method, force=True)
