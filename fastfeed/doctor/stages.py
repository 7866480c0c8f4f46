"""Where a sample's time goes: each stage of the dataset's own pipeline, timed by name.

After the script has stopped, the doctor reads a few dozen samples of the script's dataset in
its own process, with one intra-op thread as a loader worker has, and with timers put around
what it recognises, taken off again after:

- the **file read**: the raw bytes of the sample's file, where the dataset lists its files
  (``samples`` of a torchvision ``ImageFolder``/``DatasetFolder``, ``im_files`` of Ultralytics);
- the dataset's **decode**: its ``loader`` (torchvision: open and decode) or ``load_image``
  (Ultralytics: read, decode and resize);
- each **transform** of a list ``.transforms`` (torchvision's ``Compose`` v1 and v2,
  Ultralytics' ``Compose``, anything shaped like them), or of a dataset's ``transform`` or
  ``transforms`` that is itself a list or tuple, nested lists included, by class name; a
  single transform that is not a list, as a whole;
- the rest of ``__getitem__``, and the **collate**, per sample.

Times are exclusive, as a profiler's "self" time: a stage that calls another (Ultralytics'
Mosaic loads three more images through ``load_image``) is charged only its own work, so the
stages add up to the sample's cost. Transforms are wrapped in place in their lists (a
torchvision dataset's ``StandardTransform`` holds the same ``Compose``), a tuple replaced by
a tuple of timed ones, and given back after.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, Subset

__all__ = ["StageClock", "StageCost", "profile_samples"]

# Stage kinds: the report and the recommendations read them (a Pillow decode, say).
READ, DECODE, TRANSFORM, GETITEM, COLLATE = "read", "decode", "transform", "getitem", "collate"


class StageClock:
    """Accumulates the exclusive seconds of named stages, which may nest."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.seconds: dict[str, float] = {}
        self.kinds: dict[str, str] = {}
        self._nested: list[float] = []  # per open stage, the time its inner stages took

    def run(self, name: str, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
            ) -> Any:
        """``fn(*args, **kwargs)``, charged to ``name`` less what nested stages took."""
        self._nested.append(0.0)
        start = self._clock()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = self._clock() - start
            own = elapsed - self._nested.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + own
            self.kinds.setdefault(name, kind)
            if self._nested:
                self._nested[-1] += elapsed


class _Timed:
    """A callable charged to a stage of a :class:`StageClock`; other attributes are the
    wrapped object's."""

    def __init__(self, fn: Callable[..., Any], name: str, kind: str, clock: StageClock) -> None:
        self._fn, self._name, self._kind, self._clock = fn, name, kind, clock

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._clock.run(self._name, self._kind, self._fn, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


@dataclass(frozen=True)
class StageCost:
    """Milliseconds per sample of one stage."""

    stage: str
    ms: float
    kind: str


class _Instruments:
    """The timers put on one dataset, and how to take each off."""

    def __init__(self, clock: StageClock) -> None:
        self.clock = clock
        self._undo: list[Callable[[], None]] = []
        self._names: dict[str, int] = {}

    def name(self, base: str) -> str:
        count = self._names[base] = self._names.get(base, 0) + 1
        return base if count == 1 else f"{base} #{count}"

    def attribute(self, obj: Any, attr: str, name: str, kind: str) -> None:
        """Time ``obj.attr`` through an instance attribute (a method's too)."""
        had, before = attr in vars(obj), vars(obj).get(attr)
        setattr(obj, attr, _Timed(getattr(obj, attr), name, kind, self.clock))
        self._undo.append(lambda: setattr(obj, attr, before) if had else delattr(obj, attr))

    def sequence(self, owner: Any, attr: str) -> bool:
        """Time each transform of ``owner.attr``, a list (in place) or a tuple (replaced), and
        the lists inside them; False when it is neither."""
        transforms = getattr(owner, attr, None)
        if isinstance(transforms, list):
            original = list(transforms)
            self._undo.append(lambda: transforms.__setitem__(slice(None), original))
            transforms[:] = [self._timed(t) for t in original]
            return True
        if isinstance(transforms, tuple):
            had = attr in vars(owner)
            setattr(owner, attr, tuple(self._timed(t) for t in transforms))
            self._undo.append(lambda: setattr(owner, attr, transforms) if had
                              else delattr(owner, attr))
            return True
        return False

    def _timed(self, transform: Any) -> _Timed:
        self.sequence(transform, "transforms")  # a Compose, RandomApply, ... inside the list
        return _Timed(transform, self.name(type(transform).__name__), TRANSFORM, self.clock)

    def dataset(self, dataset: Any) -> None:
        """Put timers on ``dataset`` and on the datasets it wraps (``.dataset``)."""
        for level in _levels(dataset):
            state = vars(level) if hasattr(level, "__dict__") else {}
            loader = state.get("loader")
            if callable(loader):
                label = getattr(loader, "__name__", type(loader).__name__)
                self.attribute(level, "loader", f"open + decode ({label})", DECODE)
            if callable(getattr(level, "load_image", None)):
                self.attribute(level, "load_image", "load_image (read, decode, resize)", DECODE)
            for attr in ("transform", "transforms"):
                pipeline = state.get(attr)
                # A plain list of transforms, or an object holding one (Compose-shaped).
                if ((isinstance(pipeline, (list, tuple)) and self.sequence(level, attr))
                        or self.sequence(pipeline, "transforms")):
                    break
                if attr == "transform" and callable(pipeline):
                    self.attribute(level, attr, type(pipeline).__name__, TRANSFORM)
                    break

    @property
    def installed(self) -> bool:
        return bool(self._undo)

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


def _levels(dataset: Any, depth: int = 4) -> Iterator[Any]:
    """The dataset and those it wraps, outermost first."""
    for _ in range(depth):
        yield dataset
        dataset = getattr(dataset, "dataset", None)
        if not isinstance(dataset, Dataset):
            return


def _file_of(dataset: Any, index: int) -> str | None:
    """The file a map-style dataset reads for ``index``, where it lists its files."""
    while isinstance(dataset, Subset):
        index, dataset = dataset.indices[index], dataset.dataset
    for attr in ("samples", "im_files"):
        files = getattr(dataset, attr, None)
        if isinstance(files, (list, tuple)) and 0 <= index < len(files):
            entry = files[index]
            path = entry[0] if isinstance(entry, tuple) else entry
            if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
                return os.fspath(path)
    return None


def _read(path: str) -> None:
    with open(path, "rb") as f:
        f.read()


def _samples(dataset: Any, clock: StageClock, getitem: str, budget_s: float, most: int,
             least: int) -> list[Any]:
    """Read samples through the clock until ``most`` or the budget (after ``least``)."""
    deadline = time.perf_counter() + budget_s
    if isinstance(dataset, IterableDataset):
        stream = iter(dataset)
        return [clock.run(getitem, GETITEM, next, stream)
                for _ in _until(deadline, most, least)]
    order = list(range(len(dataset)))
    random.Random(0).shuffle(order)
    samples = []
    for index in _until(deadline, min(most, len(order)), least):
        path = _file_of(dataset, order[index])
        if path is not None:
            clock.run("file read", READ, _read, path)
        samples.append(clock.run(getitem, GETITEM, dataset.__getitem__, order[index]))
    return samples


def _until(deadline: float, most: int, least: int) -> Iterator[int]:
    for count in range(most):
        if count >= least and time.perf_counter() > deadline:
            return
        yield count


def profile_samples(dataset: Any, collate_fn: Callable[[Any], Any] | None,
                    batch_size: int | None, budget_s: float = 3.0, most: int = 64,
                    least: int = 4, threads: int | None = 1) -> tuple[list[StageCost], Any]:
    """Milliseconds per sample of each stage, largest first (see the module's docstring), and
    the last batch collated (``None`` without a collate function).

    Args:
        dataset: the script's dataset; its timers are taken off before this returns.
        collate_fn, batch_size: the loader's; ``batch_size=None`` collates sample by sample.
        budget_s: stop reading after this long, once ``least`` samples are read.
        most: read at most this many samples.
        threads: torch's intra-op threads while reading: 1 by default, as torch sets in each
            loader worker (more would also measure thread contention on a busy machine);
            ``None`` keeps this process's (for a loader without workers).
    """
    clock = StageClock()
    instruments = _Instruments(clock)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        instruments.dataset(dataset)
        getitem = ("__iter__, per sample" if isinstance(dataset, IterableDataset) else
                   "__getitem__ (rest)" if instruments.installed else "__getitem__")
        samples = _samples(dataset, clock, getitem, budget_s, most, least)
    finally:
        instruments.restore()
        torch.set_num_threads(before)
    batch = None
    if collate_fn is not None and samples:
        size = batch_size or 1
        for start in range(0, len(samples), size):
            chunk = samples[start:start + size]
            batch = clock.run("collate", COLLATE, collate_fn, chunk if batch_size else chunk[0])
    count = max(1, len(samples))
    costs = [StageCost(name, 1000 * seconds / count, clock.kinds[name])
             for name, seconds in clock.seconds.items()]
    return sorted(costs, key=lambda cost: cost.ms, reverse=True), batch
