"""Small generated data for the client-library tests (``tests/test_clients_*.py``), and the
skip of a test module whose client library is not there.

Everything is written offline into a test's ``tmp_path``: a few dozen tiny JPEGs, so that
each side-by-side run takes well under a second.
"""

from __future__ import annotations

import functools
import importlib
import io
import random
from typing import Any

import numpy as np
import pytest

from fastfeed.vision.synthetic import make_image


def import_or_skip(*modules: str) -> None:
    """Import ``modules`` for a test module of the client environment, or skip the whole test
    module: a library missing, or built for another torch (torchvision's wheels raise a
    RuntimeError beside the CPU build of torch)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as error:
            pytest.skip(f"needs {module}: {error}", allow_module_level=True)


def jpeg(rng: random.Random, width: int = 32, height: int = 24) -> bytes:
    """One small photo-like JPEG."""
    buffer = io.BytesIO()
    make_image(rng, width, height).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@functools.cache
def labelled_jpegs(count: int, classes: int = 5, seed: int = 0) -> tuple[tuple[bytes, int], ...]:
    """``count`` (JPEG bytes, label) pairs, made once per process: the images' grain comes
    from Pillow's own unseeded noise, so two datasets compared must share these bytes."""
    rng = random.Random(seed)
    return tuple((jpeg(rng), i % classes) for i in range(count))


def array_sample(index: int) -> dict[str, Any]:
    """Sample ``index`` of the streaming datasets: a small uint8 image array and a label."""
    rng = np.random.default_rng(index)
    return {"x": rng.integers(0, 256, (3, 8, 8), dtype=np.uint8), "label": index % 5}
