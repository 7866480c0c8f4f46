"""``fastfeed bench``: runs end to end, and bad input is one line, never a traceback."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fastfeed.progress import progress

ROOT = Path(__file__).resolve().parents[1]


def bench(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "fastfeed", "bench", *args],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_synthetic_run_writes_table_json_and_chart(tmp_path):
    out = bench("--data", "synthetic", "--workers", "0,2", "--batches", "4", "--repeats", "1",
                "--batch-size", "8", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "stock" in out.stdout and "fastfeed" in out.stdout and "vs stock" in out.stdout
    results = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert {(r["config"], r["workers"]) for r in results} == {
        ("stock", "0"), ("fastfeed", "0"), ("stock", "2"), ("fastfeed", "2")}
    assert all(0 <= r["stall_pct"] <= 100 and r["samples_per_s"] > 0 for r in results)
    assert "\r" not in out.stderr  # not a terminal: whole progress lines, as in a log file
    assert out.stderr.splitlines()[-1] == "fastfeed bench 4/4"
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_image_folder_and_module_sources(tmp_path):
    import os

    from fastfeed.vision.synthetic import make_imagefolder

    folder = make_imagefolder(tmp_path / "imgs", images=24, classes=2)
    out = bench("--data", str(folder), "--workers", "2", "--batches", "2", "--repeats", "1",
                "--batch-size", "8", "--out", str(tmp_path / "a"))
    assert out.returncode == 0, out.stderr
    assert "classify folder" in out.stdout
    configs = {r["config"] for r in
               json.loads((tmp_path / "a" / "bench.json").read_text())["results"]}
    # NVIDIA's recipe where DALI is installed, a note where it is not: never a crash.
    assert "dali" in configs or "dali: not installed" in out.stdout
    if "dali" in configs and "torchvision" not in configs:
        # Its baseline did not run: the table and a line under it say why it has no speed-up.
        assert "n/a*" in out.stdout
        assert "*dali: no speed-up: it is compared with the torchvision row" in out.stdout
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"))
    out = bench("--data", "sample_datasets:TensorDataset", "--workers", "0", "--batches", "2",
                "--repeats", "1", "--batch-size", "4", "--out", str(tmp_path / "b"), env=env)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--data", "/no/such/dir"], "no such directory"),
    (["--data", "no_such_module_xyz:make"], "cannot import"),
    (["--data", "json:no_such_function"], "has no function"),
    (["--data", "json:dumps"], "raised TypeError"),
    (["--workers", "two"], "expected counts"),
    (["--device", "tpu"], "expected cpu or cuda"),
])
def test_bad_input_is_one_line(args, message, tmp_path):
    out = bench(*args, "--out", str(tmp_path))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastfeed bench: error:"), out.stderr
    assert message in lines[0] and "Traceback" not in out.stderr


def test_stall_is_shown_only_beside_a_training_step(tmp_path):
    common = ["--data", "synthetic", "--workers", "0", "--batches", "3", "--repeats", "1",
              "--batch-size", "4"]
    out = bench(*common, "--out", str(tmp_path / "a"))
    assert out.returncode == 0, out.stderr
    assert "stall %" not in out.stdout and "not shown without a training step" in out.stdout
    out = bench(*common, "--step-ms", "1", "--out", str(tmp_path / "b"))
    assert out.returncode == 0, out.stderr
    assert "stall %" in out.stdout


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("total", [25, None])
def test_progress_writes_whole_lines_when_not_a_terminal(total, capsys):
    assert list(progress(range(25), total=total, desc="runs")) == list(range(25))
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert lines[-1] == ("runs 25/25" if total else "runs 25")
    assert all(line.startswith("runs ") for line in lines)
    assert len(lines) <= 10 if total else len(lines) == 25


def test_progress_redraws_one_line_on_a_terminal(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert list(progress(range(5), total=5, desc="runs")) == list(range(5))
    assert "\r" in terminal.getvalue()


@pytest.mark.parametrize("with_stall", [False, True])
def test_chart_title_fits_with_two_configurations(with_stall):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from fastfeed.bench.report import chart

    results = [{"config": c, "workers": "2", "changes": change, "samples_per_s": 900.0,
                "stall_pct": 40.0, "first_batch_s": 0.5, "peak_rss_mb": 300.0}
               for c, change in (("stock", "baseline"), ("fastfeed", "loader"))]
    title = ("classify folder /data/imagenet-like-1000 (1000 images, 50 classes): batch 64, "
             "step 0 ms, medians of 3")
    fig = chart(results, title, with_stall)
    fig.canvas.draw()
    [suptitle] = [t for t in fig.findobj(Text) if t.get_text().startswith("classify")]
    box = suptitle.get_window_extent()
    assert box.x0 >= 0 and box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1
    assert " ".join(suptitle.get_text().split()) == title  # wrapped, not shortened
    plt.close(fig)


def test_every_row_says_what_it_changes():
    """A dataset swap's speed-up is never shown as the loader's (issue 35): on image folders
    the ``fastfeed`` row changes dataset and transforms too, and the table says so."""
    from fastfeed.bench.data import TORCHVISION_CONFIGS, changes, changes_note
    from fastfeed.bench.report import rows

    assert changes("stock", "classify") == changes("torchvision", "classify") == "baseline"
    assert changes("fastfeed", "tensors") == changes("torchvision+swap", "classify") == "loader"
    assert changes("fastfeed", "classify") == "loader, dataset, transforms"
    assert changes("torchvision+accelerate", "classify") == "loader, dataset"
    assert all(changes(c, "classify") for c in ("fastfeed+device", "dali", *TORCHVISION_CONFIGS))
    folder = [{"config": c, "workers": "2", "changes": changes(c, "classify"),
               "samples_per_s": rate, "stall_pct": 0.0, "first_batch_s": 0.1,
               "peak_rss_mb": 100.0} for c, rate in (("stock", 100.0), ("fastfeed", 250.0))]
    assert [row[:2] for row in rows(folder)] == [["stock", "baseline"],
                                                 ["fastfeed", "loader, dataset, transforms"]]
    note = changes_note(folder)
    assert note is not None and "not the loader's alone" in note and "fastfeed: " in note
    tensors = [dict(r, changes=changes(r["config"], "tensors")) for r in folder]
    assert changes_note(tensors) is None


def test_the_table_fits_80_columns_with_nothing_cut(monkeypatch, capsys):
    pytest.importorskip("rich")
    from fastfeed.bench.data import TORCHVISION_CONFIGS, changes
    from fastfeed.bench.report import write_table

    monkeypatch.setenv("COLUMNS", "80")
    configs = ["stock", "fastfeed", "dali", *TORCHVISION_CONFIGS]
    results = [{"config": c, "workers": "auto", "changes": changes(c, "classify"),
                "samples_per_s": 123_456.0, "stall_pct": 99.0, "first_batch_s": 10.5,
                "peak_rss_mb": 12_345.0} for c in configs]
    write_table(results, "classify folder: batch 64, step 5 ms, medians of 3")
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" not in out and all(c in out for c in configs)
    assert "transforms" in out and "12,345" in out and "123,456" in out


def test_help_shows_the_defaults():
    import argparse

    from fastfeed.bench import add_arguments

    parser = argparse.ArgumentParser(prog="fastfeed bench")
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for default in ("(default: synthetic)", "(default: 64)", "(default: 2)", "(default: 50)",
                    "(default: 3)", "(default: 1000)"):
        assert default in text, default
