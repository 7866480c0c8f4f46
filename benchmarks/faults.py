"""What each fault produces, and how fast: the exception and the time from fault to error.

    python benchmarks/faults.py
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastfeed import FastLoader


class Faulty(Dataset):
    """Index 6 triggers the fault; the time it does so is written to ``stamp``."""

    def __init__(self, fault: str, stamp: str) -> None:
        self.fault, self.stamp = fault, stamp

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 6:
            Path(self.stamp).write_text(repr(time.time()))
            if self.fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "sigsegv":
                os.kill(os.getpid(), signal.SIGSEGV)
            if self.fault == "exit":
                os._exit(3)
            if self.fault == "exception":
                raise KeyError("bad sample 6")
            if self.fault == "hang":
                time.sleep(30)
        return torch.tensor(i)


def run(cls: type, fault: str, **kwargs: object) -> tuple[str, str, float]:
    stamp = f"/tmp/fastfeed-fault-{os.getpid()}"
    loader = cls(Faulty(fault, stamp), batch_size=2, num_workers=2, **kwargs)
    try:
        for _ in loader:
            pass
    except Exception as error:  # the point is to show it
        caught = time.time()
        started = float(Path(stamp).read_text())
        return type(error).__name__, str(error).splitlines()[0][:110], caught - started
    return "none", "", 0.0


def main() -> None:
    cases = [("worker SIGKILL", "sigkill", {}), ("worker SIGKILL, persistent", "sigkill",
              {"persistent_workers": True}), ("worker SIGSEGV", "sigsegv", {}),
             ("worker os._exit(3)", "exit", {}), ("dataset exception", "exception", {}),
             ("hang with timeout=1", "hang", {"timeout": 1})]
    print("| fault | loader | exception | message | seconds to error |")
    print("|---|---|---|---|---|")
    for label, fault, kwargs in cases:
        for cls in (DataLoader, FastLoader):
            kind, message, seconds = run(cls, fault, **kwargs)
            print(f"| {label} | {cls.__name__} | {kind} | `{message}` | {seconds:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
