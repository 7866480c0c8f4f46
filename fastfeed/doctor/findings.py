"""What the doctor found: the record its measuring process writes and its report reads.

It is also the ``--json`` file, so its field names are the documented schema
(docs/doctor.md): ``verdict``, ``stall_fraction``, ``consumer_samples_per_s``,
``loader_ceiling_samples_per_s``, ``per_sample_ms`` (``{stage, ms}``, largest first) and
``recommendations`` (``{change, speedup, same_batches}``), among others.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Diagnosis", "Option", "Stage", "Unmeasured"]

# Outcomes: a report, or the one line that says why there is none.
REPORT = "report"
SCRIPT_FAILED = "script-failed"
NO_LOADER = "no-loader"
ENDED_EARLY = "ended-early"


@dataclass
class Stage:
    """Milliseconds spent in one stage (per sample, or per batch), and its kind."""

    stage: str
    ms: float
    kind: str = ""


@dataclass
class Option:
    """A configuration measured loader-alone: the line to paste, its median samples/s (of
    ``rates``, one per repeat), its speed-up over the script's loader and whether it kept the
    batches (``None``: unknown). ``gpu_work``: it runs work of its own on the GPU, whose time
    per sample (beyond the script's loader's) is ``gpu_ms_per_sample`` where NVML measured
    it; ``training_speedup``: for such an option, the most training can gain once the model
    step shares the GPU with it."""

    change: str
    speedup: float
    same_batches: bool | None
    samples_per_s: float
    key: str = ""
    note: str = ""
    rates: list[float] = field(default_factory=list)
    gpu_work: bool = False
    gpu_ms_per_sample: float | None = None
    training_speedup: float | None = None


@dataclass
class Unmeasured:
    """A change that applies, and why it carries no number."""

    change: str
    reason: str


@dataclass
class Diagnosis:
    """Everything the report says; see docs/doctor.md for each field."""

    outcome: str
    message: str = ""  # why there is no report (with an outcome other than REPORT)
    script: str = ""
    argv: list[str] = field(default_factory=list)
    verdict: str | None = None
    evidence: list[str] = field(default_factory=list)
    stall_fraction: float | None = None
    stall_source: str = "host"  # or "cuda events": the GPU's idle time while waiting
    consumer_samples_per_s: float | None = None
    model_samples_per_s: float | None = None  # the pace if data were free
    loader_ceiling_samples_per_s: float | None = None
    time_to_first_batch_s: float | None = None
    loader: dict[str, Any] = field(default_factory=dict)
    other_loaders: list[dict[str, Any]] = field(default_factory=list)
    window: dict[str, Any] = field(default_factory=dict)
    timeline_ms: dict[str, list[float]] = field(default_factory=dict)  # "wait", "compute"
    system: dict[str, Any] = field(default_factory=dict)
    per_sample_ms: list[Stage] = field(default_factory=list)
    # Why the stage figures are not given (the loader measured faster than they allow).
    stages_ruled_out: str = ""
    per_batch_ms: list[Stage] = field(default_factory=list)
    recommendations: list[Option] = field(default_factory=list)
    measured: list[Option] = field(default_factory=list)
    unmeasured: list[Unmeasured] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def write(self, path: Path) -> None:
        path.write_text(self.to_json())

    @classmethod
    def read(cls, path: Path) -> Diagnosis:
        data = json.loads(path.read_text())
        for name, kind in (("per_sample_ms", Stage), ("per_batch_ms", Stage),
                           ("recommendations", Option), ("measured", Option),
                           ("unmeasured", Unmeasured)):
            data[name] = [kind(**item) for item in data.get(name, [])]
        return cls(**data)
