"""A/B of two source trees of fastfeed on one benchmark's child run, alternated.

A change that must lose no speed is measured against the commit before it: check that commit
out beside this one (``git worktree add /tmp/before <commit>``, then build its extensions with
``python setup.py build_ext --inplace`` there), and run the same child of the same benchmark
script from each tree in turn, in fresh processes, the order reversed every other round, so
that the drift of a busy machine spreads over both. Each child imports fastfeed from its own
tree (the benchmark scripts put their tree first on ``sys.path``).

Beside each child's own figure, its CPU time (user and system, its worker processes included)
is reported: the same work in each tree, it drifts far less than wall time with the load.

The child's last line of output is JSON: a list of rates (``--one`` children of the pipeline
benchmarks) or an object, or a list of objects, from which ``--key`` picks the figure
(``overhead.py --child``; ``ultralytics_pipeline.py --one``, ``--key wall``)::

    python benchmarks/ab_trees.py --trees before=/tmp/before after=. --rounds 6 \\
        --key batches_per_s -- overhead.py --child fastfeed float32 128 2 64 0
    .venv-clients/bin/python benchmarks/ab_trees.py --trees before=/tmp/before after=. \\
        -- torchvision_pipeline.py --one accelerate --data DIR --workers 2 --epochs 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastfeed.progress import progress


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def child_run(python: str, tree: Path, command: list[str], key: str | None
              ) -> tuple[list[float], float]:
    """The figures one child run of ``command`` (a script under ``tree/benchmarks``) prints,
    and the CPU seconds it took."""
    script, *args = command
    cpu = _children_cpu_s()
    out = subprocess.run([python, str(tree / "benchmarks" / script), *args],
                         capture_output=True, text=True, check=False, cwd=tree)
    cpu = _children_cpu_s() - cpu
    if out.returncode:
        sys.exit(f"{tree}: {script} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if key is not None:  # of the object, or of each object in the list
        result = [r[key] for r in result] if isinstance(result, list) else result[key]
    return [float(r) for r in (result if isinstance(result, list) else [result])], cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs=2, required=True, metavar="NAME=PATH",
                        help="the baseline tree first, then the tree under test")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--key", help="the figure in a child's JSON object")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- SCRIPT ARGS...: a child run of a script in benchmarks/")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    trees = {name: Path(path).resolve() for name, path in (t.split("=", 1) for t in args.trees)}
    names = list(trees)
    jobs = [n for r in range(args.rounds) for n in (names if r % 2 == 0 else names[::-1])]
    rates: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    load_before = os.getloadavg()[0]
    for name in progress(jobs, total=len(jobs), desc="A/B"):
        figures, seconds = child_run(sys.executable, trees[name], command, args.key)
        rates[name] += figures
        cpu[name].append(seconds)
    load_after = os.getloadavg()[0]
    base, test = (statistics.median(rates[n]) for n in names)
    base_cpu, test_cpu = (statistics.median(cpu[n]) for n in names)
    print(f"{' '.join(command)}: median of {args.rounds} alternated runs per tree")
    print("| tree | median | range | CPU s per run (median) |\n|---|---|---|---|")
    for name in names:
        print(f"| {name} ({trees[name]}) | {statistics.median(rates[name]):,.1f} | "
              f"{min(rates[name]):,.1f}–{max(rates[name]):,.1f} | "
              f"{statistics.median(cpu[name]):.2f} |")
    print(f"\n{names[1]} / {names[0]}: **{test / base:.3f}×** the figure, "
          f"{test_cpu / base_cpu:.3f}× the CPU time; load average (1 min) "
          f"{load_before:.1f} before, {load_after:.1f} after, on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
