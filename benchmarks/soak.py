"""Soak: run FastLoader for a given time and report memory and descriptors over time.

Epochs alternate between a persistent loader and fresh iterators abandoned at random points,
so both the long-lived and the churn paths are exercised. Every ``--every`` seconds it records
the RSS of the main process plus its workers, open file descriptors, threads, child processes
and /dev/shm entries. Flat columns are the pass criterion.

    python benchmarks/soak.py --minutes 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastfeed import FastLoader


def collate(samples: list[dict]) -> dict:
    """Detection-style: stacked images, concatenated variable-length boxes."""
    return {"img": torch.stack([s["img"] for s in samples]),
            "boxes": torch.cat([s["boxes"] for s in samples]),
            "names": [s["name"] for s in samples]}


class Images(Dataset):
    def __init__(self, n: int = 512) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"img": torch.full((3, 96, 96), i % 251, dtype=torch.uint8),
                "boxes": torch.rand(i % 5, 4), "name": f"{i}.jpg"}


def _children() -> list[int]:
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        out.append(int(entry))
            except OSError:
                pass
    return out


def _rss_mb(pid: int | str) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def reading(elapsed: float, epochs: int, batches: int) -> dict:
    children = _children()
    return {
        "t_s": round(elapsed), "epochs": epochs, "batches": batches,
        "rss_mb": round(_rss_mb("self") + sum(_rss_mb(p) for p in children), 1),
        "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
        "children": len(children), "shm_entries": len(os.listdir("/dev/shm")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between readings")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    persistent = FastLoader(Images(), batch_size=32, num_workers=args.workers,
                            persistent_workers=True, shuffle=True, collate_fn=collate)
    churn = FastLoader(Images(), batch_size=32, num_workers=args.workers, shuffle=True,
                       collate_fn=collate)
    rng = random.Random(0)
    start = next_reading = time.monotonic()
    epochs = batches = 0
    readings = []
    print("| t (s) | epochs | batches | RSS MB | fds | threads | children | /dev/shm |")
    print("|---|---|---|---|---|---|---|---|")
    while True:
        now = time.monotonic()
        if now >= next_reading:
            r = reading(now - start, epochs, batches)
            readings.append(r)
            print(f"| {r['t_s']} | {r['epochs']} | {r['batches']} | {r['rss_mb']} | {r['fds']} "
                  f"| {r['threads']} | {r['children']} | {r['shm_entries']} |", flush=True)
            next_reading += args.every
        if now - start >= args.minutes * 60:
            break
        if epochs % 2 == 0:
            for batch in persistent:
                batch["img"].float().mean()
                batches += 1
        else:
            stop = rng.randrange(len(churn))
            for i, batch in enumerate(churn):
                batch["img"].float().mean()
                batches += 1
                if i == stop:
                    break
        del batch
        epochs += 1
    if args.json:
        args.json.write_text(json.dumps(readings, indent=2))


if __name__ == "__main__":
    main()
