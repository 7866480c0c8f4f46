"""A forked process's first gathers from its parent's memory, against the parent's own.

A loader's worker processes are forked from the training process and read the samples it
holds. This times the same gather in both: ``--gb`` of stored uint8 3×224×224 samples in one
tensor (written, so every page is in memory before the fork), 128 random samples a batch
gathered with fastfeed's ``stack_into`` (one thread) into 5 outputs taken in turn, and per
chunk of batches the milliseconds a batch and the page faults a batch (``ru_minflt``), first in
the parent, then in a child forked after it. The child gathers into the parent's outputs, as
it inherits them, so its first write to each of their pages is a copy-on-write fault;
``--child-outputs`` has it make its own.

    python benchmarks/forked_gather.py
    python benchmarks/forked_gather.py --child-outputs
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastfeed._stack import stack_into

SAMPLE = (3, 224, 224)
BATCH = 128


def outputs() -> list[torch.Tensor]:
    return [torch.zeros((BATCH, *SAMPLE), dtype=torch.uint8) for _ in range(5)]


def timed_chunks(who: str, data: torch.Tensor, outs: list[torch.Tensor], batches: int,
                 chunk: int) -> None:
    """Prints ms a batch and faults a batch for each ``chunk`` of ``batches`` gathers."""
    generator = torch.Generator().manual_seed(os.getpid())
    for first in range(0, batches, chunk):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        for k in range(chunk):
            picks = torch.randint(0, len(data), (BATCH,), generator=generator).tolist()
            stack_into(outs[k % len(outs)], [data[i] for i in picks], threads=1)
        ms = (time.perf_counter() - start) / chunk * 1e3
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / chunk
        print(f"| {who} | {first}–{first + chunk} | {ms:.2f} | {faults:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=3.0)
    parser.add_argument("--batches", type=int, default=900)
    parser.add_argument("--chunk", type=int, default=150)
    parser.add_argument("--child-outputs", action="store_true",
                        help="the child makes its own outputs (no copy-on-write faults)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = int(args.gb * 1e9) // (3 * 224 * 224)
    data = torch.empty((n, *SAMPLE), dtype=torch.uint8)
    data.fill_(7)  # every page in memory before the fork
    outs = outputs()
    print("| process | batches | ms a batch | page faults a batch |\n|---|---|---|---|")
    timed_chunks("parent", data, outs, args.batches, args.chunk)
    pid = os.fork()
    if pid == 0:
        try:
            timed_chunks("forked child", data, outputs() if args.child_outputs else outs,
                         args.batches, args.chunk)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
