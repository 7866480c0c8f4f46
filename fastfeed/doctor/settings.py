"""The doctor's options, as the command line hands them to the measuring process."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from fastfeed.doctor.probe import Window

__all__ = ["Settings"]


@dataclass(frozen=True)
class Settings:
    """The command line's options, as the measuring process takes them."""

    warmup: int = 5
    batches: int = 50
    seconds: float = 30.0
    let_finish: bool = False
    repeats: int = 3
    trial_batches: int = 30
    trial_seconds: float = 10.0
    profile_seconds: float = 3.0

    def window(self) -> Window:
        return Window(self.warmup, self.batches, self.seconds, stop=not self.let_finish)

    def to_json(self) -> str:
        return json.dumps(asdict(self))
