"""Where a sample's time goes: each stage of the dataset's own pipeline, timed by name.

After the script has stopped, the doctor reads a few dozen samples of the script's dataset
(a shorter dataset again, as later epochs read it), with one intra-op thread as a loader
worker has, and with timers put around what it recognises, taken off again after:

- the **file read**: the raw bytes of the sample's file, where the dataset lists its files
  (``samples`` of a torchvision ``ImageFolder``/``DatasetFolder``, ``im_files`` of Ultralytics);
- the dataset's **decode**: its ``loader`` (torchvision: open and decode) or ``load_image``
  (Ultralytics: read, decode and resize);
- each **transform** of a list ``.transforms`` (torchvision's ``Compose`` v1 and v2,
  Ultralytics' ``Compose``, anything shaped like them), or of a dataset's ``transform`` or
  ``transforms`` that is itself a list or tuple, nested lists included; a single transform
  that is not a list, as a whole. Each is named as :func:`stage_name` says: a function by its
  qualified name, a lambda by its file and line, a ``functools.partial`` by the function it
  wraps, a callable object by its class;
- the rest of ``__getitem__``, and the **collate**, per sample.

Every stage is timed as a loader worker runs it: with one intra-op thread (torch sets one in
each worker). With more, on a machine whose other cores are busy, each parallel op waits for a
core, and a collate that takes a millisecond in a worker reads as a hundred. The time the
thread spent waiting for a CPU (the kernel's run-queue delay,
:class:`~fastfeed.doctor.system.ThreadRunDelay`) is left out too: a stage's figure is what it
costs a worker that has a core, however busy the machine was while it was timed (how long the
workers waited for a core is the report's machine line).

Times are exclusive, as a profiler's "self" time: a stage that calls another (Ultralytics'
Mosaic loads three more images through ``load_image``) is charged only its own work, so the
stages add up to the sample's cost. Transforms are wrapped in place in their lists (a
torchvision dataset's ``StandardTransform`` holds the same ``Compose``), a tuple replaced by
a tuple of timed ones; the timers go in and come off through the patching kit's
:class:`~fastfeed._patching.Swaps`.
"""

from __future__ import annotations

import functools
import inspect
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, Subset

from fastfeed._patching import Swaps
from fastfeed.doctor.system import ThreadRunDelay

__all__ = ["StageClock", "StageCost", "most_samples_per_s", "profile_samples", "stage_name"]

# Stage kinds: the report and the recommendations read them (a Pillow decode, say).
READ, DECODE, TRANSFORM, GETITEM, COLLATE = "read", "decode", "transform", "getitem", "collate"


class StageClock:
    """Accumulates the exclusive seconds of named stages, which may nest: the time each took,
    less what ``waited`` says the thread spent waiting for a CPU meanwhile.

    Args:
        clock: seconds, monotonic.
        waited: seconds this thread has waited for a CPU so far (the scheduler's run-queue
            delay); none by default.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 waited: Callable[[], float] = lambda: 0.0) -> None:
        self._clock, self._waited = clock, waited
        self.seconds: dict[str, float] = {}
        self.kinds: dict[str, str] = {}
        self._nested: list[float] = []  # per open stage, the time its inner stages took

    def run(self, name: str, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
            ) -> Any:
        """``fn(*args, **kwargs)``, charged to ``name`` less what nested stages took."""
        self._nested.append(0.0)
        waited = self._waited()
        start = self._clock()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = self._clock() - start - (self._waited() - waited)
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


def stage_name(transform: Any) -> str:
    """The name the report gives a transform (or a dataset's loader).

    A function by its qualified name (``random_crop``, ``Augment.flip``), a builtin by its
    module and name (``torch.neg``), a lambda by its file and line (``<lambda> at train.py:12``),
    a ``functools.partial`` by the function it wraps, a callable object by its class.
    """
    while isinstance(transform, functools.partial):
        transform = transform.func
    if inspect.isbuiltin(transform):  # torch.neg's qualified name is a private class's
        module = getattr(transform, "__module__", None)
        return f"{module}.{transform.__name__}" if module else transform.__name__
    if inspect.isfunction(transform) and transform.__name__ == "<lambda>":
        code = transform.__code__
        return f"<lambda> at {os.path.basename(code.co_filename)}:{code.co_firstlineno}"
    if inspect.isroutine(transform):  # functions and methods
        return str(transform.__qualname__)
    name = getattr(transform, "__name__", None)  # numpy's ufuncs, named instances
    return name if isinstance(name, str) else type(transform).__name__


class _Instruments:
    """The timers put on one dataset; :meth:`restore` takes them all off."""

    def __init__(self, clock: StageClock) -> None:
        self.clock = clock
        self._swaps = Swaps()
        self._names: dict[str, int] = {}

    def name(self, base: str) -> str:
        count = self._names[base] = self._names.get(base, 0) + 1
        return base if count == 1 else f"{base} #{count}"

    def attribute(self, obj: Any, attr: str, name: str, kind: str) -> None:
        """Time ``obj.attr`` through an instance attribute (a method's too)."""
        self._swaps.wrap(obj, attr, lambda original: _Timed(original, name, kind, self.clock))

    def sequence(self, owner: Any, attr: str) -> bool:
        """Time each transform of ``owner.attr``, a list (in place) or a tuple (replaced), and
        the lists inside them; False when it is neither."""
        transforms = getattr(owner, attr, None)
        if isinstance(transforms, list):
            for index, transform in enumerate(transforms):
                self._swaps.set_item(transforms, index, self._timed(transform))
            return True
        if isinstance(transforms, tuple):
            self._swaps.set(owner, attr, tuple(self._timed(t) for t in transforms))
            return True
        return False

    def _timed(self, transform: Any) -> _Timed:
        self.sequence(transform, "transforms")  # a Compose, RandomApply, ... inside the list
        return _Timed(transform, self.name(stage_name(transform)), TRANSFORM, self.clock)

    def dataset(self, dataset: Any) -> None:
        """Put timers on ``dataset`` and on the datasets it wraps (``.dataset``)."""
        for level in _levels(dataset):
            state = vars(level) if hasattr(level, "__dict__") else {}
            loader = state.get("loader")
            if callable(loader):
                self.attribute(level, "loader", f"open + decode ({stage_name(loader)})", DECODE)
            if callable(getattr(level, "load_image", None)):
                self.attribute(level, "load_image", "load_image (read, decode, resize)", DECODE)
            for attr in ("transform", "transforms"):
                pipeline = state.get(attr)
                # A plain list of transforms, or an object holding one (Compose-shaped).
                if ((isinstance(pipeline, (list, tuple)) and self.sequence(level, attr))
                        or self.sequence(pipeline, "transforms")):
                    break
                if attr == "transform" and callable(pipeline):
                    self.attribute(level, attr, self.name(stage_name(pipeline)), TRANSFORM)
                    break

    @property
    def installed(self) -> bool:
        return bool(self._swaps)

    def restore(self) -> None:
        self._swaps.undo()


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
             least: int, batch: int) -> list[Any]:
    """Read samples through the clock until ``most`` or the budget (after ``least``), in
    whole batches of ``batch`` where ``most`` holds one."""
    deadline = time.perf_counter() + budget_s
    if batch > most:
        batch = 1
    most -= most % batch
    if isinstance(dataset, IterableDataset):
        stream = iter(dataset)
        return [clock.run(getitem, GETITEM, next, stream)
                for _ in _until(deadline, most, least, batch)]
    samples: list[Any] = []
    indices = _epochs(len(dataset))
    for _ in _until(deadline, most if len(dataset) else 0, least, batch):
        index = next(indices)
        path = _file_of(dataset, index)
        if path is not None:
            clock.run("file read", READ, _read, path)
        samples.append(clock.run(getitem, GETITEM, dataset.__getitem__, index))
    return samples


def _epochs(length: int) -> Iterator[int]:
    """Indices as shuffled epochs read them, epoch after epoch: a dataset shorter than the
    samples read is read again, so that its own caches (Ultralytics keeps the images it
    loaded) serve the share they serve the loader's workers, whose measured rate the stages
    are held against. Each epoch in an order of its own: the same order again would defeat a
    cache of one image less than the dataset at every access."""
    rng = random.Random(0)
    while True:
        order = list(range(length))
        rng.shuffle(order)
        yield from order


def _until(deadline: float, most: int, least: int, batch: int) -> Iterator[int]:
    for count in range(most):
        if count >= least and count % batch == 0 and time.perf_counter() > deadline:
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
        budget_s: stop reading after this long, once ``least`` samples are read, at the end
            of a batch.
        most: read at most this many samples (whole batches, where it holds one).
        threads: torch's intra-op threads while reading and collating: 1 by default, as torch
            sets in each loader worker; ``None`` keeps this process's (for a loader without
            workers, whose main process does the work).
    """
    run_delay = ThreadRunDelay()
    clock = StageClock(waited=run_delay)
    instruments = _Instruments(clock)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        instruments.dataset(dataset)
        getitem = ("__iter__, per sample" if isinstance(dataset, IterableDataset) else
                   "__getitem__ (rest)" if instruments.installed else "__getitem__")
        try:
            samples = _samples(dataset, clock, getitem, budget_s, most, least,
                               batch_size or 1)
        finally:
            instruments.restore()
        batch = _collate(samples, collate_fn, batch_size, clock)
    finally:
        torch.set_num_threads(before)
        run_delay.close()
    count = max(1, len(samples))
    costs = [StageCost(name, 1000 * seconds / count, clock.kinds[name])
             for name, seconds in clock.seconds.items()]
    return sorted(costs, key=lambda cost: cost.ms, reverse=True), batch


def _collate(samples: list[Any], collate_fn: Callable[[Any], Any] | None,
             batch_size: int | None, clock: StageClock) -> Any:
    """Collate ``samples`` in batches as the loader would, each timed; the last batch."""
    if collate_fn is None:
        return None
    batch, size = None, batch_size or 1
    for start in range(0, len(samples), size):
        chunk = samples[start:start + size]
        batch = clock.run("collate", COLLATE, collate_fn, chunk if batch_size else chunk[0])
    return batch


def most_samples_per_s(costs: list[StageCost], workers: int) -> float | None:
    """The most samples a second a loader could deliver if each sample cost what ``costs``
    say: ``workers`` processes (the main process alone for 0), each running a sample's stages
    one after another; ``None`` without a cost."""
    total_ms = sum(cost.ms for cost in costs)
    return max(1, workers) * 1000 / total_ms if total_ms > 0 else None
