"""The short table that ``benchmarks/gpu_suite.sh`` prints last: each stage's outcome, then the
figures of its JSON files.

    python benchmarks/gpu_figures.py LOG_FOLDER

The folder holds ``stages.tsv`` (one ``name, exit code, seconds`` line per stage run), each
stage's ``NAME.log`` and the JSON files the benchmarks wrote. Every dict in a JSON file that has
``images_per_s`` is one row, named by its keys' path (the benchmarks' own layouts differ: a
dict of configurations, of feeds, a list of runs); a file with ``medians`` gives those only.
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


def outcome(code: int, log: Path) -> str:
    """What a stage came to: pytest's counts where it printed them, else its exit."""
    text = log.read_text(errors="replace") if log.exists() else ""
    counts = _PYTEST_COUNTS.findall(text)
    if code == 124:
        ran = f", {counts[-1]} before" if counts else ""
        return f"cut at its time limit{ran}"
    if counts:
        return counts[-1]
    return "ok" if code == 0 else f"exit {code}"


def rows(value: Any, path: tuple[str, ...] = ()) -> list[tuple[str, dict[str, Any]]]:
    """Each dict with ``images_per_s`` below ``value``, with the path of keys that leads there."""
    if isinstance(value, dict):
        if "images_per_s" in value:
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


def table(folder: Path) -> str:
    lines = ["| stage | outcome | seconds |", "|---|---|---|"]
    stages = folder / "stages.tsv"
    for line in stages.read_text().splitlines() if stages.exists() else []:
        name, code, seconds = line.split("\t")
        lines.append(f"| {name} | {outcome(int(code), folder / f'{name}.log')} | {seconds} |")
    figures = [(f"{path.stem} {label}".strip(), found)
               for path in sorted(folder.glob("*.json"))
               for label, found in rows(json.loads(path.read_text()))]
    if figures:
        lines += ["", "| figures | images/s | waiting for data | GPU busy |", "|---|---|---|---|"]
        lines += [f"| {label} | {found['images_per_s']:,.0f} | {_first(found, _WAIT_KEYS)} | "
                  f"{_first(found, _BUSY_KEYS)} |" for label, found in figures]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(table(Path(sys.argv[1])))


if __name__ == "__main__":
    main()
