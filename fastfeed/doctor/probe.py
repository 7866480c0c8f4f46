"""The probe: times every batch a script takes from a DataLoader, and hands it over untouched.

Installed in the doctor's child process before the user's script runs, :meth:`Probe.install`
wraps, at class level, ``DataLoader.__init__`` and, as each loader is built, the ``__iter__`` of
every DataLoader class in its MRO: torch's, FastLoader, Ultralytics' ``InfiniteDataLoader``, a
user's subclass. Only the ``__iter__`` a call resolves to first returns a timed iterator; an
override's ``super().__iter__()`` gets the plain one, so FastLoader still finds its own iterator
type underneath. A timed iterator forwards every attribute to the real one and returns each
batch as it came; a timed ``next()`` inside another (a loader that draws from another loader)
passes straight through, so no wait is counted twice.

Per loader, a :class:`LoaderTrace` splits the script's time into steps, one per batch: the
*wait* (inside ``next()``, plus ``iter()`` and an epoch's final ``next()`` since the previous
batch) and the *compute* (from a batch's delivery to the next request, less those waits). A step
in which another loader delivered a batch (a validation pass) is marked unclean and left out of
the figures. The first ``warmup`` batches (worker start-up) are not measured; the window then
closes after ``batches`` steps or ``seconds``, whichever comes first, and the next request
raises :class:`WindowClosed` (or, with ``stop=False``, passes through untimed).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import DataLoader

from fastfeed._patching import Swaps
from fastfeed.doctor.gpu_waits import GpuWaits
from fastfeed.telemetry import batch_length

__all__ = ["LoaderTrace", "Probe", "Window", "WindowClosed"]


class WindowClosed(BaseException):
    """Raised into the script at the end of the window. A BaseException, so that the script's
    own ``except Exception`` does not swallow it; frameworks that clean up on any exception
    (Lightning's teardown) do so and re-raise it."""


@dataclass(frozen=True)
class Window:
    """What the doctor watches: ``warmup`` batches, then ``batches`` steps or ``seconds``."""

    warmup: int = 5
    batches: int = 50
    seconds: float = 30.0
    stop: bool = True  # raise WindowClosed at the end; else let the script run on, untimed


@dataclass
class LoaderTrace:
    """The steps of one loader, in the order its batches were delivered."""

    name: str
    auto_collation: bool
    gpu: GpuWaits
    first_iter_at: float | None = None
    delivered_at: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    computes: list[float] = field(default_factory=list)
    clean: list[bool] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    window_start: float | None = None
    pending_wait: float = 0.0  # waited outside next() since the last delivery
    mark: int = -1  # the probe's delivery count right after this loader's last batch

    @property
    def batches(self) -> int:
        return len(self.delivered_at)

    def complete_step(self, now: float, deliveries: int) -> None:
        """The script asks for a batch: the previous batch's step (if still open) ends."""
        if len(self.computes) < len(self.delivered_at):
            self.computes.append(now - self.delivered_at[-1] - self.pending_wait)
            self.clean.append(deliveries == self.mark)

    def deliver(self, requested: float, now: float, batch: Any, deliveries: int) -> None:
        self.waits.append(now - requested + self.pending_wait)
        self.pending_wait = 0.0
        self.delivered_at.append(now)
        self.samples.append(batch_length(batch, self.auto_collation))
        self.mark = deliveries


class _TimedIterator:
    """The iterator a script gets: ``next()`` is timed, everything else is the real one's.

    It keeps its loader alive, as long as the script iterates: torch's iterators do not hold
    their loader, and ``for batch in DataLoader(...)`` drops it at once, but the doctor reads
    the loader's arguments when the window closes.
    """

    def __init__(self, inner: Iterator[Any], loader: DataLoader, trace: LoaderTrace,
                 probe: Probe) -> None:
        self._inner, self._loader, self._trace, self._probe = inner, loader, trace, probe

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        return self._probe.next_batch(self._inner, self._loader, self._trace)

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Probe:
    """Finds and times the loaders of a script; see the module's docstring.

    Args:
        window: what to watch.
        on_start: called with the trace and its loader when a loader's window opens.
        on_close: called likewise when the window closes, before anything is raised.
        gpu_waits: makes each trace's sync-aware GPU clock (tests pass a stand-in).
    """

    def __init__(self, window: Window,
                 on_start: Callable[[LoaderTrace, DataLoader], None] | None = None,
                 on_close: Callable[[LoaderTrace, DataLoader], None] | None = None,
                 gpu_waits: Callable[[], GpuWaits] = GpuWaits) -> None:
        self.window = window
        self.traces: list[LoaderTrace] = []
        self.closed_by: LoaderTrace | None = None
        self._on_start, self._on_close, self._gpu_waits = on_start, on_close, gpu_waits
        self._by_loader: weakref.WeakKeyDictionary[DataLoader, LoaderTrace] = (
            weakref.WeakKeyDictionary())
        self._iter_wrappers: dict[type, Callable[..., Any]] = {}
        self._swaps = Swaps()
        self._local = threading.local()
        self._deliveries = 0

    @property
    def closed(self) -> bool:
        return self.closed_by is not None

    # -- installation ------------------------------------------------------------------------

    def install(self) -> None:
        """Wrap ``DataLoader.__init__`` and the ``__iter__`` of every DataLoader class so far."""
        original_init = DataLoader.__init__
        probe = self

        def __init__(loader: DataLoader, *args: Any, **kwargs: Any) -> None:
            original_init(loader, *args, **kwargs)
            probe._wrap_classes(type(loader))

        self._swaps.set(DataLoader, "__init__", __init__)
        stack: list[type] = [DataLoader]
        while stack:  # classes imported before the script: FastLoader, at least
            cls = stack.pop()
            self._wrap_classes(cls)
            stack.extend(cls.__subclasses__())

    def uninstall(self) -> None:
        """Give every wrapped class its own methods back."""
        self._swaps.undo()
        self._iter_wrappers.clear()

    def _wrap_classes(self, loader_class: type) -> None:
        for cls in loader_class.__mro__:
            if (issubclass(cls, DataLoader) and "__iter__" in cls.__dict__
                    and cls not in self._iter_wrappers):
                self._iter_wrappers[cls] = self._timed_iter(cls, cls.__dict__["__iter__"])
                self._swaps.set(cls, "__iter__", self._iter_wrappers[cls])

    def _timed_iter(self, cls: type, original: Callable[[DataLoader], Any]
                    ) -> Callable[[DataLoader], Any]:
        probe = self

        def __iter__(loader: DataLoader) -> Any:
            # Only the __iter__ the call resolved to first times; inner super() calls must hand
            # their caller the real iterator. A loader made without __init__ (unpickled) may
            # have an unwrapped override above us: then nothing times this call, and its class
            # is wrapped for the next one.
            if type(loader).__iter__ is not probe._iter_wrappers.get(cls):
                probe._wrap_classes(type(loader))
                return original(loader)
            start = time.perf_counter()
            return probe.watch(loader, original(loader), since=start)

        __iter__.__qualname__ = f"{cls.__qualname__}.__iter__"
        __iter__.__doc__ = original.__doc__
        return __iter__

    def watch(self, loader: DataLoader, iterator: Iterator[Any], since: float | None = None
              ) -> Iterator[Any]:
        """``iterator`` (of ``loader``) with every ``next()`` timed; ``since``: when the script
        asked ``loader`` for it (the time to make it counts as waiting)."""
        trace = self._trace(loader)
        if since is not None:
            if trace.first_iter_at is None:
                trace.first_iter_at = since
            trace.pending_wait += time.perf_counter() - since
        return _TimedIterator(iterator, loader, trace, self)

    def _trace(self, loader: DataLoader) -> LoaderTrace:
        trace = self._by_loader.get(loader)
        if trace is None:
            kind = type(loader)
            trace = LoaderTrace(f"{kind.__module__}.{kind.__qualname__}",
                                loader.batch_sampler is not None, self._gpu_waits())
            self._by_loader[loader] = trace
            self.traces.append(trace)
        return trace

    # -- the hot path ------------------------------------------------------------------------

    def next_batch(self, inner: Iterator[Any], loader: DataLoader, trace: LoaderTrace) -> Any:
        """``next(inner)``, timed for ``loader``'s ``trace`` (the timed iterator's
        ``__next__``)."""
        if getattr(self._local, "busy", False) or (self.closed and not self.window.stop):
            return next(inner)
        now = time.perf_counter()
        trace.complete_step(now, self._deliveries)
        if self.closed or self._closes(loader, trace, now):
            raise WindowClosed
        # The wait starts after the probe's own work at a window's start (reading /proc):
        # that time is the doctor's, in neither the step's compute nor its wait.
        requested = time.perf_counter()
        gpu_mark = trace.gpu.request()
        self._local.busy = True
        try:
            batch = next(inner)
        except StopIteration:  # the epoch's end: this wait belongs to the next epoch's first batch
            trace.pending_wait += time.perf_counter() - requested
            raise
        finally:
            self._local.busy = False
        now = time.perf_counter()
        trace.gpu.deliver(trace.batches, gpu_mark)
        self._deliveries += 1
        trace.deliver(requested, now, batch, self._deliveries)
        return batch

    def _closes(self, loader: DataLoader, trace: LoaderTrace, now: float) -> bool:
        """Opens and closes ``trace``'s window at a request; True when it has just closed."""
        window = self.window
        if trace.window_start is None:
            if trace.batches < window.warmup:
                return False
            trace.window_start = now
            if self._on_start is not None:
                self._on_start(trace, loader)
        steps = len(trace.computes) - window.warmup
        if steps < window.batches and (steps < 1 or now - trace.window_start < window.seconds):
            return False
        self.closed_by = trace
        trace.gpu.finish()
        if self._on_close is not None:
            self._on_close(trace, loader)
        return window.stop
