"""Comparison helpers: every batch of FastLoader must equal torch's, leaf for leaf."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from fastfeed import FastLoader


def assert_same(a: Any, b: Any, path: str = "batch") -> None:
    """Assert two batches are equal: same types, dtypes, shapes, values, structure."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.equal(a, b), f"{path}: values differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: array layout differs"
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def outcomes(loader: Any) -> list[tuple[Any, ...]]:
    """Every batch (as a list) or error (its type and first line) of an epoch, in order,
    iteration going on after an error as torch allows."""
    results: list[tuple[Any, ...]] = []
    iterator = iter(loader)
    while True:
        try:
            results.append(("batch", next(iterator).tolist()))
        except StopIteration:
            return results
        except Exception as error:  # the tests compare them
            results.append(("error", type(error).__name__, str(error).splitlines()[0]))


def run_epochs(loader: DataLoader, epochs: int, seed: int) -> list[list[Any]]:
    """Iterate ``epochs`` epochs, reseeding the global RNGs first so both loaders see the same."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    return [list(loader) for _ in range(epochs)]


def compare(
    dataset_factory, epochs: int = 1, seed: int = 0, fast: dict | None = None, **kwargs: Any
) -> int:
    """Run torch's DataLoader and FastLoader with the same arguments; assert equal batches.

    ``generator`` may be passed as an int seed, and ``sampler``/``batch_sampler`` as factories:
    each loader then gets its own, so that neither consumes the other's random draws.
    ``fast`` holds FastLoader-only options. Returns the number of batches compared.
    """
    def build(cls):
        options = dict(kwargs, **(fast or {}) if cls is FastLoader else {})
        if isinstance(options.get("generator"), int):
            options["generator"] = torch.Generator().manual_seed(options["generator"])
        for key in ("sampler", "batch_sampler"):
            if callable(options.get(key)):
                options[key] = options[key]()
        return cls(dataset_factory(), **options)

    expected = run_epochs(build(DataLoader), epochs, seed)
    actual = run_epochs(build(FastLoader), epochs, seed)
    assert len(actual) == len(expected)
    count = 0
    for e, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert len(got) == len(want), f"epoch {e}: {len(got)} batches, torch gave {len(want)}"
        for i, (x, y) in enumerate(zip(want, got, strict=True)):
            assert_same(x, y, f"epoch {e} batch {i}")
            count += 1
    return count


@contextlib.contextmanager
def host_syncs_raise() -> Iterator[None]:
    """On a real GPU, from a synchronised start: any host sync inside raises (torch's sync
    debug mode), where it would otherwise pass unseen."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
