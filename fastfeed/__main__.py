"""The ``fastfeed`` command line: ``fastfeed info`` and ``fastfeed bench``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fastfeed`` and ``python -m fastfeed``."""
    parser = argparse.ArgumentParser(prog="fastfeed", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, extensions, CUDA, NVML, DALI, CPUs, /dev/shm")
    bench = commands.add_parser("bench", help="compare with the stock DataLoader on your data",
                                description="Compare the stock DataLoader with FastLoader.")
    from fastfeed.bench import add_arguments, run

    add_arguments(bench)
    args = parser.parse_args(argv)
    if args.command == "info":
        from fastfeed.info import collect, format_report

        print(format_report(collect()))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
