"""The doctor's measuring process: runs the user's script under the probe, then measures.

``python -m fastfeed.doctor.child RESULT SETTINGS SCRIPT [ARGS...]`` runs SCRIPT as ``python
SCRIPT ARGS`` would (as ``__main__``, with ``sys.argv`` and ``sys.path[0]``), under the probe, and
writes a :class:`~fastfeed.doctor.findings.Diagnosis` to RESULT. The script's output and its
own traceback go to this process's stdout and stderr as they would without the doctor. Only
the command line (:mod:`fastfeed.doctor.cli`) starts it, in a session of its own, so that
whatever the script leaves running can be found and stopped.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

from torch.utils.data import DataLoader

from fastfeed.doctor.findings import ENDED_EARLY, NO_LOADER, SCRIPT_FAILED, Diagnosis
from fastfeed.doctor.loaders import LoaderSpec
from fastfeed.doctor.measure import Captured, diagnose
from fastfeed.doctor.probe import LoaderTrace, Probe, WindowClosed
from fastfeed.doctor.settings import Settings
from fastfeed.doctor.system import ProcessTree
from fastfeed.gpu_sampler import GpuSampler

__all__ = ["main", "run_script"]


@dataclass(frozen=True)
class _Opened:
    """What was read when a loader's window opened: the time, the machine, the loader's
    arguments (read now, so that the loader itself is not kept alive: a script that drops it
    gets its persistent workers stopped as it would without the doctor)."""

    at: float
    tree: ProcessTree
    spec: LoaderSpec


class _Watch:
    """Readings taken when a loader's window opens and when it closes (or the script ends)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.probe = Probe(settings.window(), on_start=self._opened, on_close=self._closed)
        self.opened: dict[int, _Opened] = {}
        self.captured: Captured | None = None
        self.gpu: GpuSampler | None = None

    def _opened(self, trace: LoaderTrace, loader: DataLoader) -> None:
        self.opened[id(trace)] = _Opened(time.perf_counter(), ProcessTree.read(memory=False),
                                         LoaderSpec.of(loader))
        if self.gpu is None:
            self.gpu = GpuSampler()  # reads this process's current GPU; fails soft without
            self.gpu.start()

    def _closed(self, trace: LoaderTrace, loader: DataLoader) -> None:
        self.captured = self._capture(trace)

    def _capture(self, trace: LoaderTrace) -> Captured:
        opened = self.opened[id(trace)]
        gpu = self.gpu if self.gpu is not None else GpuSampler()
        gpu.stop()
        return Captured(trace, opened.spec, opened.tree, ProcessTree.read(),
                        time.perf_counter() - opened.at,
                        gpu.reading(opened.at, trace.delivered_at[-1]), gpu.status)

    def script_ended(self) -> bool:
        """The script ended with no window closed: capture the loader that completed the most
        steps after its warm-up, if any did (an epoch shorter than the window). The machine's
        figures then run to the script's end."""
        warmup = self.settings.warmup
        seen = [t for t in self.probe.traces
                if id(t) in self.opened and len(t.computes) > warmup]
        if not seen:
            return False
        trace = max(seen, key=lambda t: len(t.computes))
        trace.gpu.finish()
        self.captured = self._capture(trace)
        return True


def _script_frames(error: BaseException, script: str) -> traceback.TracebackException:
    """The error as Python would print it for ``python SCRIPT``: from the script's frame on."""
    tb = error.__traceback__
    target = os.path.abspath(script)
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != target:
        tb = tb.tb_next
    return traceback.TracebackException(type(error), error, tb or error.__traceback__)


def _chain(error: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while error is not None and all(error is not e for e in seen):
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def _as_main(script: str) -> types.ModuleType:
    """A module for ``script`` as ``python SCRIPT`` makes it, installed as ``__main__``.

    It stays ``__main__`` after the script has stopped (unlike ``runpy``'s, which is taken
    back): the loader-alone runs rebuild the script's loader, and workers started by spawn or
    forkserver find the script's classes through ``__main__``'s file.
    """
    main = types.ModuleType("__main__")
    main.__file__ = script
    sys.modules["__main__"] = main
    return main


def run_script(script: str, args: list[str], probe: Probe) -> str | None:
    """Run ``script`` as ``__main__``; ``None`` when it ended or the window stopped it, else
    what went wrong, in a few words (a traceback is printed as Python prints it)."""
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        code = compile(Path(script).read_bytes(), script, "exec")
        exec(code, vars(_as_main(script)))
    except SystemExit as exit:
        if exit.code not in (None, 0):
            return f"exit status {exit.code}"
    except BaseException as error:  # the script's own error, whatever it is
        if any(isinstance(e, WindowClosed) for e in _chain(error)) and probe.closed:
            return None  # the window's stop, re-raised (or wrapped) by a framework
        report = _script_frames(error, script)
        print("".join(report.format()), end="", file=sys.stderr, flush=True)
        last = "".join(report.format_exception_only()).strip().splitlines()[-1]
        return f"{last} (its traceback is above)"
    return None


def _ended_early(delivered: int, settings: Settings) -> str:
    """Why there is no step to report on (the script ended within the warm-up), and a
    warm-up that would leave some."""
    hint = f"--warmup {delivered - 2}" if delivered >= 3 else "a longer run"
    return (f"it ended after {delivered} batches, within the {settings.warmup} warm-up "
            f"batches: no training step was measured (try {hint})")


def main(argv: list[str] | None = None) -> int:
    result, settings_json, script, *args = sys.argv[1:] if argv is None else argv
    settings = Settings(**json.loads(settings_json))
    watch = _Watch(settings)
    watch.probe.install()
    try:
        error = run_script(script, args, watch.probe)
    finally:
        watch.probe.uninstall()
    gc.collect()  # the script's iterators, and the workers they hold, go now
    stopped = watch.probe.closed
    delivered = max((t.batches for t in watch.probe.traces), default=0)
    # A run shorter than the window is reported on the steps it had, if it had any.
    seen = stopped or (error is None and delivered > 0 and watch.script_ended())
    base = Diagnosis(outcome="", script=script, argv=args)
    if not stopped and error is not None:
        base.outcome, base.message = SCRIPT_FAILED, f"it failed before the window closed: {error}"
    elif not stopped and delivered == 0:
        base.outcome, base.message = NO_LOADER, "it never iterated a DataLoader"
    elif not seen or watch.captured is None:
        base.outcome, base.message = ENDED_EARLY, _ended_early(delivered, settings)
    else:
        base = diagnose(base, watch.captured, watch.probe, settings)
        if error is not None:
            base.notes.append(f"after the window, the script failed: {error}")
    base.write(Path(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
