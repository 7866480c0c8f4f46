"""Show ``fastfeed bench`` results: a table (rich if installed), a JSON file, a PNG chart."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from fastfeed.bench.data import baseline, beyond_loader

__all__ = ["chart", "missing_baselines", "write_chart", "write_json", "write_table"]

COLUMNS = ["config", "changes", "workers", "samples/s", "vs stock", "stall %", "first batch s",
           "peak RSS MB"]


def _columns(with_stall: bool) -> list[str]:
    return COLUMNS if with_stall else [c for c in COLUMNS if c != "stall %"]


def rows(results: list[dict[str, Any]], with_stall: bool = True) -> list[list[str]]:
    stock = {(r["config"], r["workers"]): r["samples_per_s"] for r in results
             if r["config"] == baseline(r["config"])}
    out = []
    for r in results:
        family = baseline(r["config"])
        base = stock.get((family, r["workers"])) or next(
            (v for (c, _), v in stock.items() if c == family), None)
        cells = {"config": r["config"], "changes": r["changes"], "workers": str(r["workers"]),
                 "samples/s": f"{r['samples_per_s']:,.0f}",
                 "vs stock": f"{r['samples_per_s'] / base:.2f}×" if base else "n/a*",
                 "stall %": f"{r['stall_pct']:.1f}", "first batch s": f"{r['first_batch_s']:.2f}",
                 "peak RSS MB": f"{r['peak_rss_mb']:,.0f}"}
        out.append([cells[c] for c in _columns(with_stall)])
    return out


def missing_baselines(results: list[dict[str, Any]]) -> dict[str, str]:
    """The configurations whose baseline did not run (``dali``'s is ``torchvision``), each
    with that baseline: their speed-up cannot be shown (``n/a*`` in the table, and a line
    under it says why)."""
    ran = {r["config"] for r in results}
    return {r["config"]: baseline(r["config"]) for r in results
            if baseline(r["config"]) not in ran}


def write_table(results: list[dict[str, Any]], title: str, with_stall: bool = True) -> None:
    """Print the table: with rich if it is installed, else as aligned plain text.

    Without a training step (``with_stall=False``) the consumer only waits, so the data stall
    is near 100 % for every loader and says nothing: the column is left out.
    """
    body = rows(results, with_stall)
    columns = _columns(with_stall)
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(columns)]
        print(title)
        for line in [columns, *body]:
            print("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)))
        return
    # Fits 80 columns with nothing cut: no vertical rules, a configuration's name and the
    # numbers on one line each, what a row changes wrapped between words (never inside one),
    # and, where the table is wider than the terminal on one line, the headings on several.
    console = Console()
    one_line = sum(max(len(c), *(len(r[i]) for r in body)) + 1 for i, c in enumerate(columns))
    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)
    for index, column in enumerate(columns):
        if column == "changes":
            table.add_column(column, min_width=max(len(word) for row in body
                                                   for word in row[index].split()))
            continue
        heading = column.replace(" ", "\n") if one_line > console.width else column
        table.add_column(heading, no_wrap=True,
                         justify="left" if column == "config" else "right")
    for row in body:
        table.add_row(*row)
    console.print(table)


def write_json(results: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=2))


def chart(results: list[dict[str, Any]], title: str, with_stall: bool = True) -> Any:
    """The matplotlib figure of :func:`write_chart`: throughput bars, and the data stall's
    beside them when a training step ran (see :func:`write_table`)."""
    import matplotlib.pyplot as plt

    labels = [f"{r['config']}\n{r['workers']} workers"
              + ("\n(not the loader alone)" if beyond_loader(r["changes"]) else "")
              for r in results]
    colors = ["#9e9e9e" if r["config"] == baseline(r["config"]) else "#1f77b4" for r in results]
    width = max(8.0, 1.6 * len(results)) * (1 if with_stall else 0.6)
    # Constrained layout keeps the suptitle inside the figure; the title is wrapped to the
    # figure's width (about 0.55 em per character at 10 pt), so a narrow chart of a few
    # configurations no longer cuts a long title at both edges.
    fig, axes = plt.subplots(1, 2 if with_stall else 1, figsize=(width, 4.6), squeeze=False,
                             layout="constrained")
    speed = axes[0][0]
    bars = speed.bar(labels, [r["samples_per_s"] for r in results], color=colors)
    speed.bar_label(bars, fmt="{:,.0f}", fontsize=8)
    speed.set_ylabel("samples / s (median)")
    speed.set_title("throughput (higher is better)", fontsize=10)
    if with_stall:
        stall = axes[0][1]
        bars = stall.bar(labels, [r["stall_pct"] for r in results], color=colors)
        stall.bar_label(bars, fmt="{:.0f}%", fontsize=8)
        stall.set_ylim(0, 105)
        stall.set_ylabel("% of wall time waiting for data")
        stall.set_title("data stall (lower is better)", fontsize=10)
    for axis in axes[0]:
        axis.tick_params(axis="x", labelsize=8)
    characters = int(width * 72 / (10 * 0.55)) - 4
    fig.suptitle(textwrap.fill(title, characters), fontsize=10)
    return fig


def write_chart(results: list[dict[str, Any]], title: str, path: Path,
                with_stall: bool = True) -> bool:
    """Save :func:`chart` as a PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = chart(results, title, with_stall)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
