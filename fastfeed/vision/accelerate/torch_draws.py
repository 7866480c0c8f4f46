"""torchvision's crop windows and flips, drawn from torch's generator without a torch op per
number.

torchvision's ``RandomResizedCrop.get_params`` makes each draw with a torch op on a
one-element tensor: 32 random bits for microseconds of dispatch, five times an image or more,
which in an accelerated worker costs a tenth of its time. :func:`draw_session` makes the same
numbers from a copy of the default generator's state (:mod:`fastfeed._mt19937` draws the
words; the formulas are those of torch's CPU kernels), and :meth:`Draws.commit` hands the
advanced copy back: the generator ends where torchvision's ops would have left it, and every
window equals torchvision's.

Nothing is assumed of how this torch was built. The first session of a process draws from a
private generator both ways and compares (:func:`_uniform_is_fused`): the words, ``randint``,
and whether ``uniform_``'s multiply-add is fused; where neither form gives torch's numbers, no
session is made. A ``uniform_`` draw that rounds to its upper bound (torch releases differ in
how they clamp it), or anything torch would refuse, raises :class:`Undecided` before anything
is committed, and the caller draws that image with torch's ops. Logarithms and exponentials
are torch's own ops: their float32 results depend on its vector library.

Only the main thread of a DataLoader worker process draws this way: anywhere else, another
thread could draw from the same generator between the copy and the hand-back.
"""

from __future__ import annotations

import functools
import importlib
import math
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import get_worker_info

try:
    # By name: an extension module is no layer of the package (see pyproject's import contract).
    _mt19937: Any = importlib.import_module("fastfeed._mt19937")
except ImportError:  # built without a compiler: torch's ops draw
    _mt19937 = None

__all__ = ["Draws", "Undecided", "draw_session", "draws_like_torchvision"]


class Undecided(Exception):
    """A number this module cannot be sure to draw as torch would: torch's ops draw it."""


class Draws:
    """The default generator's next numbers, from a copy of its state (see :func:`draw_session`).

    Args:
        state: a copy of the generator's state (``torch.get_rng_state()``), advanced in place.
        fused: whether this torch's ``uniform_`` fuses its multiply-add.
    """

    def __init__(self, state: torch.Tensor, fused: bool) -> None:
        self._state = state
        self._address = state.data_ptr()
        self._fused = fused

    def _word(self) -> int:
        return _mt19937.draw_words(self._address, 1)[0]

    def uniform(self, low: float, high: float) -> float:
        """``torch.empty(1).uniform_(low, high).item()`` in float32."""
        if not low <= high:
            raise Undecided  # torch's own error, from torch's op
        value = _mt19937.uniform_float(self._word(), low, high, self._fused)
        if value is None:
            raise Undecided
        return value

    def rand(self) -> float:
        """``torch.rand(1).item()``."""
        return self.uniform(0.0, 1.0)

    def randint(self, low: int, high: int) -> int:
        """``torch.randint(low, high, size=(1,)).item()``."""
        span = high - low
        if not 0 < span < 2**28:  # torch's error, or 64-bit draws (from 2**28 or 2**32 on)
            raise Undecided
        return low + self._word() % span

    def resized_crop(self, width: int, height: int, scale: Sequence[float],
                     ratio: Sequence[float]) -> tuple[int, int, int, int]:
        """``(top, left, height, width)``: what torchvision's
        ``RandomResizedCrop.get_params`` returns for a ``width``×``height`` image, with the same
        draws in the same order (up to ten tries of an area and an aspect ratio, then the
        offsets; a centre crop when no try fits)."""
        area = height * width
        log_low, log_high = _log_ratio(tuple(ratio))
        for _ in range(10):
            target_area = area * self.uniform(scale[0], scale[1])
            aspect_ratio = _exp(self.uniform(log_low, log_high))
            w = round(math.sqrt(target_area * aspect_ratio))
            h = round(math.sqrt(target_area / aspect_ratio))
            if 0 < w <= width and 0 < h <= height:
                return self.randint(0, height - h + 1), self.randint(0, width - w + 1), h, w
        in_ratio = float(width) / float(height)
        if in_ratio < min(ratio):
            w, h = width, round(width / min(ratio))
        elif in_ratio > max(ratio):
            w, h = round(height * max(ratio)), height
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def commit(self) -> None:
        """Hand the advanced state back: the generator continues after the numbers drawn."""
        torch.set_rng_state(self._state)


@functools.lru_cache(maxsize=16)
def _log_ratio(ratio: tuple[float, ...]) -> tuple[float, float]:
    log_ratio = torch.log(torch.tensor(ratio))
    return float(log_ratio[0]), float(log_ratio[1])


def _exp(value: float) -> float:
    """torch's float32 exp of ``value``, on a one-element tensor as torchvision computes it."""
    return torch.exp(torch.tensor([value], dtype=torch.float32)).item()


@functools.cache
def _uniform_is_fused() -> bool | None:
    """Whether this torch's ``uniform_`` fuses its multiply-add (None: neither form, or the
    words or ``randint``, give torch's numbers here). Measured once a process, on a private
    generator, over the ranges RandomResizedCrop and its flips draw from."""
    generator = torch.Generator().manual_seed(20261207)
    draws = 4096
    ranges = [(0.08, 1.0), _log_ratio((3.0 / 4.0, 4.0 / 3.0)), (0.0, 1.0), (0.25, 0.75)]
    agrees = {True: True, False: True}
    for low, high in ranges:
        state = generator.get_state()
        expected = torch.empty(draws).uniform_(low, high, generator=generator).tolist()
        words = _mt19937.draw_words(state.data_ptr(), draws)
        for fused in agrees:
            made = [_mt19937.uniform_float(w, low, high, fused) for w in words]
            agrees[fused] &= made == expected
    for span in (224, 333, 65_537):
        state = generator.get_state()
        expected = torch.randint(0, span, (draws,), generator=generator).tolist()
        if [w % span for w in _mt19937.draw_words(state.data_ptr(), draws)] != expected:
            return None
    if agrees[True] != agrees[False]:
        return agrees[True]
    return False if agrees[False] else None


def draw_session() -> Draws | None:
    """Draws from a copy of the default generator's state, or None where they must be drawn
    with torch's ops: outside a worker process's main thread, without the extension, with a
    default dtype other than float32 (torchvision's one-element tensors would be of it), or
    where this torch's numbers could not be reproduced."""
    if (_mt19937 is None or get_worker_info() is None
            or threading.current_thread() is not threading.main_thread()
            or torch.get_default_dtype() != torch.float32):
        return None
    fused = _uniform_is_fused()
    if fused is None:
        return None
    return Draws(torch.get_rng_state(), fused)


def draws_like_torchvision(transform: Any) -> bool:
    """Whether ``transform`` is torchvision's (v1) ``RandomResizedCrop`` drawing with its own
    ``get_params``, which :meth:`Draws.resized_crop` reproduces."""
    try:
        from torchvision.transforms import RandomResizedCrop
    except ImportError:
        return False
    return (isinstance(transform, RandomResizedCrop)
            and type(transform).get_params is RandomResizedCrop.get_params)
