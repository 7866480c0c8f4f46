"""Small generated data for the client-library tests (``tests/test_clients_*.py``).

Everything is written offline into a test's ``tmp_path``: a few dozen tiny JPEGs, so that
each side-by-side run takes well under a second.
"""

from __future__ import annotations

import io
import random

from fastfeed.vision.synthetic import make_image


def jpeg(rng: random.Random, width: int = 32, height: int = 24) -> bytes:
    """One small photo-like JPEG."""
    buffer = io.BytesIO()
    make_image(rng, width, height).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def labelled_jpegs(count: int, classes: int = 5, seed: int = 0) -> list[tuple[bytes, int]]:
    """``count`` (JPEG bytes, label) pairs, the same for the same seed."""
    rng = random.Random(seed)
    return [(jpeg(rng), i % classes) for i in range(count)]
