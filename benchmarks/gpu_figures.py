"""The short table that ``benchmarks/gpu_suite.sh`` prints last: each stage's outcome, then the
figures of its JSON files.

    python benchmarks/gpu_figures.py LOG_FOLDER

The folder holds ``stages.tsv`` (one ``name, exit code, seconds[, note]`` line per stage run;
``n/a`` for the code of a stage that could not apply, the note saying why), each stage's
``NAME.log`` and the JSON files the benchmarks wrote. Every dict in a JSON file that has
``images_per_s`` (or a feed's ``error``) is one row, named by its keys' path (the benchmarks'
own layouts differ: a dict of configurations, of feeds, a list of runs); a file with
``medians`` gives those only. A file with ``parts`` (``benchmarks/gpu_paths.py``) gives each
part's verdict and figures.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

# pytest's closing line: "3 failed, 570 passed, 12 skipped in 81.2s"
_PYTEST_COUNTS = re.compile(r"(\d+ (?:failed|passed|skipped|errors?|xfailed|xpassed)"
                            r"(?:, \d+ (?:failed|passed|skipped|errors?|xfailed|xpassed))*)")
_WAIT_KEYS = ("wait_share", "stall", "data_stall")
_BUSY_KEYS = ("gpu_busy", "gpu_busy_share")


def outcome(code: str, log: Path, note: str = "") -> str:
    """What a stage came to: n/a and why, pytest's counts where it printed them, else its
    exit."""
    if code == "n/a":
        return f"n/a: {note}"
    text = log.read_text(errors="replace") if log.exists() else ""
    counts = _PYTEST_COUNTS.findall(text)
    if code == "124":
        ran = f", {counts[-1]} before" if counts else ""
        return f"cut at its time limit{ran}"
    if counts:
        return counts[-1]
    return "ok" if code == "0" else f"exit {code}"


def rows(value: Any, path: tuple[str, ...] = ()) -> list[tuple[str, dict[str, Any]]]:
    """Each dict with ``images_per_s`` below ``value``, with the path of keys that leads there."""
    if isinstance(value, dict):
        if "images_per_s" in value or "error" in value:
            return [(" ".join(path), value)]
        if "medians" in value:  # runs and their medians: the medians
            return rows(value["medians"], path)
        return [row for key, inner in value.items() for row in rows(inner, (*path, str(key)))]
    if isinstance(value, list):  # items named by their own "feed", "config" or "name"
        return [row for i, inner in enumerate(value)
                for row in rows(inner, (*path, _name(inner, str(i))))]
    return []


def _name(item: Any, default: str) -> str:
    if isinstance(item, dict):
        return str(next((item[k] for k in ("feed", "config", "name") if k in item), default))
    return default


def _first(figures: dict[str, Any], keys: tuple[str, ...]) -> str:
    for key in keys:
        value = figures.get(key)
        if isinstance(value, list):  # one figure per GPU
            value = value[0] if value else None
        if isinstance(value, (int, float)):
            return f"{100 * value:.1f} %" if value <= 1 else f"{value:.1f} %"
    return ""


def _figures(result: dict[str, Any]) -> str:
    """A part's figures, ``name=value``, one level of cases deep."""
    shown = []
    for key, value in result.items():
        if key in ("verdict", "batches"):
            continue
        if isinstance(value, dict):
            shown.append(f"{key}: {_figures(value)}".strip())
        elif isinstance(value, float):
            shown.append(f"{key}={value:.3g}")
        elif isinstance(value, (int, str, list)):
            shown.append(f"{key}={value}")
    return "; ".join(shown)


def table(folder: Path) -> str:
    lines = ["| stage | outcome | seconds |", "|---|---|---|"]
    stages = folder / "stages.tsv"
    for line in stages.read_text().splitlines() if stages.exists() else []:
        name, code, seconds, *note = line.split("\t")
        lines.append(f"| {name} | {outcome(code, folder / f'{name}.log', *note)} | {seconds} |")
    found = [(path, json.loads(path.read_text())) for path in sorted(folder.glob("*.json"))]
    parts = [(f"{path.stem} {part}", result) for path, value in found
             if isinstance(value, dict) and "parts" in value
             for part, result in value["parts"].items()]
    if parts:
        lines += ["", "| part | verdict | figures |", "|---|---|---|"]
        lines += [f"| {label} | {result.get('verdict', '?')} | {_figures(result)} |"
                  for label, result in parts]
    figures = [(f"{path.stem} {label}".strip(), row)
               for path, value in found for label, row in rows(value)]
    if figures:
        lines += ["", "| figures | images/s | waiting for data | GPU busy |", "|---|---|---|---|"]
        lines += [f"| {label} | failed: {row['error']} | | |" if "error" in row else
                  f"| {label} | {row['images_per_s']:,.0f} | {_first(row, _WAIT_KEYS)} | "
                  f"{_first(row, _BUSY_KEYS)} |" for label, row in figures]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(table(Path(sys.argv[1])))


if __name__ == "__main__":
    main()
