"""The ``fastfeed`` command line: ``fastfeed info``, ``fastfeed bench`` and ``fastfeed doctor``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fastfeed`` and ``python -m fastfeed``."""
    parser = argparse.ArgumentParser(prog="fastfeed", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, extensions, CUDA, NVML, DALI, CPUs, /dev/shm, "
                                     "and what each feature needs")
    bench = commands.add_parser("bench", help="compare with the stock DataLoader on your data",
                                description="Compare the stock DataLoader with FastLoader.")
    doctor = commands.add_parser(
        "doctor", help="why is my GPU idle? measured on your own training script",
        description="Run a training script for a window of steps; say whether it waits for "
                    "data, where each sample's time goes, and which change helps, measured "
                    "on its own data.")
    from fastfeed import bench as bench_cli
    from fastfeed import doctor as doctor_cli

    bench_cli.add_arguments(bench)
    doctor_cli.add_arguments(doctor)
    args = parser.parse_args(argv)
    if args.command == "info":
        from fastfeed.info import collect, features, format_report

        print(format_report(collect(), features()))
        return 0
    if args.command == "doctor":
        return doctor_cli.run(args)
    return bench_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
