"""``fastfeed doctor SCRIPT [ARGS...]``: why is my GPU idle? Measured on your own script.

Runs the script, unmodified, in a process of its own (:mod:`fastfeed.doctor.child`) for a
window of training steps, then stops it; prints the report, and writes ``--json`` and
``--out`` pictures. Bad input (a script that fails, never iterates a loader, or ends before the
window closes) is one line saying which, after the script's own error as it printed it.

The measuring process gets a session of its own: whatever the script leaves running when that
process has ended (a worker it forked and never stopped) is found by its process group,
stopped, and named in the report. Ctrl-C, SIGTERM and SIGHUP reach it as an interrupt.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from fastfeed._install import install_line
from fastfeed.doctor.findings import REPORT, SCRIPT_FAILED, Diagnosis
from fastfeed.doctor.plots import write_plots
from fastfeed.doctor.report import format_report
from fastfeed.doctor.settings import Settings
from fastfeed.doctor.system import process_group

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    window = parser.add_argument_group("the window (whichever ends first)")
    window.add_argument("--batches", type=int, default=50,
                        help="training steps to measure after the warm-up (default 50)")
    window.add_argument("--seconds", type=float, default=30.0,
                        help="seconds to measure after the warm-up (default 30)")
    window.add_argument("--warmup", type=int, default=5,
                        help="first batches left out: worker start-up (default 5)")
    window.add_argument("--let-finish", action="store_true",
                        help="let the script run to its end after the window, instead of "
                             "stopping it")
    trials = parser.add_argument_group("loader-alone runs")
    trials.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    trials.add_argument("--trial-batches", type=int, default=30,
                        help="timed batches per run (default 30)")
    trials.add_argument("--trial-seconds", type=float, default=10.0,
                        help="at most this long per run (default 10)")
    parser.add_argument("--json", type=Path, dest="json_path", metavar="PATH",
                        help="write the findings here")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="write timeline.png and stages.png here (needs matplotlib: "
                             f"{install_line('plot')})")
    parser.add_argument("script", help="the training script, as you run it with python")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")


def _settings(args: argparse.Namespace) -> Settings:
    counts = {"--batches": args.batches, "--repeats": args.repeats,
              "--trial-batches": args.trial_batches}
    for flag, value in counts.items():
        if value < 1:
            raise ValueError(f"{flag} must be at least 1")
    if args.warmup < 0 or args.seconds <= 0 or args.trial_seconds <= 0:
        raise ValueError("--warmup must be non-negative, --seconds and --trial-seconds positive")
    if not Path(args.script).is_file():
        raise ValueError(f"{args.script}: no such file")
    return Settings(args.warmup, args.batches, args.seconds, args.let_finish, args.repeats,
                    args.trial_batches, args.trial_seconds)


def _wait_empty(pgid: int, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := process_group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def stop_leftovers(pgid: int, settle: float = 2.0, grace: float = 5.0) -> list[int]:
    """Stop what is left of the measuring process's group after ``settle`` seconds (helpers
    that end when their parent does, such as multiprocessing's resource tracker, take a
    moment): SIGTERM, then SIGKILL after ``grace`` seconds. Returns the pids stopped."""
    stopped = left = _wait_empty(pgid, settle)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        left = _wait_empty(pgid, grace) if left else []
    return stopped


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def _terminations_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP (a closed terminal, a job scheduler) interrupt the wait as Ctrl-C
    does, so the measuring process, in a session of its own, is stopped rather than left
    running the script."""
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _interrupt_child(child: subprocess.Popen[bytes], patience: float = 30.0) -> None:
    """SIGINT, once a second until the child ends, then SIGKILL after ``patience`` seconds (or
    a second Ctrl-C). Once is not always enough: an interrupt that lands in a ``__del__`` (a
    DataLoader iterator shutting its workers down between epochs) is printed and ignored."""
    deadline = time.monotonic() + patience
    try:
        while child.poll() is None and time.monotonic() < deadline:
            child.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=1.0)
    except KeyboardInterrupt:
        pass
    if child.poll() is None:
        child.kill()
        child.wait()


def _measure(settings: Settings, script: str, script_args: list[str]) -> Diagnosis | None:
    """Run the measuring process; its diagnosis, or ``None`` if it died without one."""
    with tempfile.TemporaryDirectory(prefix="fastfeed-doctor-") as tmp:
        result = Path(tmp) / "diagnosis.json"
        child = subprocess.Popen([sys.executable, "-m", "fastfeed.doctor.child", str(result),
                                  settings.to_json(), script, *script_args],
                                 start_new_session=True)
        try:
            with _terminations_interrupt():
                child.wait()
        except KeyboardInterrupt:  # the child has its own session: hand it the interrupt
            _interrupt_child(child)
        left = stop_leftovers(child.pid)
        if not result.exists():
            print(f"fastfeed doctor: error: the measuring process ended without a result "
                  f"(exit status {child.returncode})", file=sys.stderr)
            return None
        diagnosis = Diagnosis.read(result)
    if left:
        diagnosis.notes.append(f"the script left {len(left)} processes running after it "
                               f"stopped (pids {', '.join(map(str, left))}); the doctor "
                               "stopped them")
    return diagnosis


def run(args: argparse.Namespace) -> int:
    """Diagnose ``args.script``; exit status 0 with a report, 1 when the script failed,
    2 for other bad input, 3 when the doctor itself failed."""
    try:
        settings = _settings(args)
    except ValueError as error:
        print(f"fastfeed doctor: error: {error}", file=sys.stderr)
        return 2
    diagnosis = _measure(settings, args.script, args.script_args)
    if diagnosis is None:
        return 3
    if diagnosis.outcome != REPORT:
        print(f"fastfeed doctor: {args.script}: {diagnosis.message}", file=sys.stderr)
        return 1 if diagnosis.outcome == SCRIPT_FAILED else 2
    print(format_report(diagnosis))
    if args.json_path is not None:
        diagnosis.write(args.json_path)
        print(f"wrote {args.json_path}")
    if args.out is not None:
        written = write_plots(diagnosis, args.out)
        print("wrote " + " and ".join(map(str, written)) if written is not None else
              f"no pictures: they need matplotlib: {install_line('plot')}")
    return 0
