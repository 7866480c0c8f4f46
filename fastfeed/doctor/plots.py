"""``--out DIR``: the step timeline and the per-stage costs, as PNGs (the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastfeed.doctor.findings import Diagnosis

__all__ = ["write_plots"]

_WAIT, _COMPUTE = "#d62728", "#1f77b4"


def _timeline(d: Diagnosis, plt: Any) -> Any:
    """The window's steps end to end: each one's wait for data, then its compute."""
    from matplotlib.patches import Patch

    waits = [ms / 1000 for ms in d.timeline_ms.get("wait", [])]
    computes = [ms / 1000 for ms in d.timeline_ms.get("compute", [])]
    starts, clock = [], 0.0
    for wait, compute in zip(waits, computes, strict=True):
        starts.append(clock)
        clock += wait + compute
    fig, axis = plt.subplots(figsize=(10, 2.6), layout="constrained")
    axis.broken_barh(list(zip(starts, waits, strict=True)), (0.2, 0.6), facecolors=_WAIT)
    axis.broken_barh([(s + w, c) for s, w, c in zip(starts, waits, computes, strict=True)],
                     (0.2, 0.6), facecolors=_COMPUTE)
    axis.set_xlim(0, clock or 1.0)
    axis.set_yticks([])
    axis.set_xlabel("seconds into the window")
    axis.legend(handles=[Patch(color=_WAIT, label="waiting for data"),
                         Patch(color=_COMPUTE, label="computing")], loc="upper right",
                fontsize=8)
    stall = 100 * (d.stall_fraction or 0.0)
    axis.set_title(f"{d.script}: {len(waits)} steps, waiting {stall:.0f}% ({d.verdict})",
                   fontsize=10)
    return fig


def _stages(d: Diagnosis, plt: Any) -> Any:
    stages = d.per_sample_ms[::-1]  # largest at the top
    fig, axis = plt.subplots(figsize=(8, 0.8 + 0.35 * len(stages)), layout="constrained")
    bars = axis.barh([s.stage for s in stages], [s.ms for s in stages], color=_COMPUTE)
    axis.bar_label(bars, fmt="{:.2f}", fontsize=8)
    axis.set_xlabel("ms per sample (exclusive)")
    axis.set_title("where a sample's time goes", fontsize=10)
    axis.tick_params(axis="y", labelsize=8)
    return fig


def write_plots(d: Diagnosis, out: Path) -> list[Path] | None:
    """Write ``timeline.png`` and ``stages.png`` (when stages were measured) into ``out``;
    ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (("timeline.png", _timeline), ("stages.png", _stages)):
        if name == "stages.png" and not d.per_sample_ms:
            continue
        fig = draw(d, plt)
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        written.append(out / name)
    return written
