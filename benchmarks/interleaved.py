"""Run configurations in fresh processes, interleaved, and tabulate medians against stock.

On a small, noisy machine absolute times drift; alternating the order of configurations from
repeat to repeat spreads the drift over all of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from fastfeed.progress import progress

__all__ = ["interleaved_rates", "interleaved_runs", "pipeline_parser", "print_ratio_table"]


def pipeline_parser(doc: str, configs: Sequence[str], batch_size: int) -> argparse.ArgumentParser:
    """The options every pipeline benchmark takes; the script adds its data options."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default=",".join(configs))
    parser.add_argument("--json", type=Path, default=None,
                        help="write the figures there as JSON (a script with a table per "
                             "metric writes NAME.METRIC.json beside it: yolo.json gives "
                             "yolo.wall.json and yolo.cpu.json)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one configuration
    return parser


def interleaved_runs(script: str | Path, configs: Sequence[str], repeats: int,
                     child_args: Sequence[str], desc: str,
                     python: Callable[[str], str] | None = None
                     ) -> Iterator[tuple[str, list[Any] | str]]:
    """Run ``script --one CONFIG *child_args`` ``repeats`` times per configuration, yielding
    each run as it ends: ``(config, the entries of the JSON list its last line printed)``, or
    ``(config, its error)`` where it failed. ``python(config)`` names the interpreter of a
    configuration's children (default: this one), for libraries that live in an environment
    of their own."""
    jobs = [c for r in range(repeats) for c in (configs if r % 2 == 0 else configs[::-1])]
    for config in progress(jobs, total=len(jobs), desc=desc):
        interpreter = python(config) if python is not None else sys.executable
        out = subprocess.run([interpreter, str(script), "--one", config, *child_args],
                             capture_output=True, text=True, check=False)
        if out.returncode:
            yield config, out.stderr.strip() or f"exit {out.returncode}"
        else:
            yield config, json.loads(out.stdout.strip().splitlines()[-1])


def interleaved_rates(script: str | Path, configs: Sequence[str], repeats: int,
                      child_args: Sequence[str], desc: str,
                      python: Callable[[str], str] | None = None) -> dict[str, list[Any]]:
    """Every entry per configuration of :func:`interleaved_runs`; exits at the first failed
    run."""
    rates: dict[str, list[Any]] = {c: [] for c in configs}
    for config, entries in interleaved_runs(script, configs, repeats, child_args, desc, python):
        if isinstance(entries, str):
            sys.exit(f"{config} failed:\n{entries}")
        rates[config] += entries
    return rates


def print_ratio_table(title: str, rates: dict[str, list[float]], unit: str = "images/s",
                      json_path: Path | None = None) -> dict[str, float]:
    """Print a markdown table of medians and their ratio to ``stock``; optionally save JSON."""
    medians = {c: statistics.median(r) for c, r in rates.items()}
    base = medians.get("stock")
    print(title)
    print(f"| loader | {unit} | vs stock |\n|---|---|---|")
    for config, value in medians.items():
        ratio = f"**{value / base:.2f}×**" if base else "n/a"
        print(f"| {config} | {value:,.0f} | {ratio} |")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"title": title, "rates": rates, "medians": medians},
                                        indent=2))
    return medians
