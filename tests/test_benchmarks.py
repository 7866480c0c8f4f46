"""The benchmark scripts run (tiny settings, CPU): figures come from them, so they must work."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script, *args):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-4000:]}"
    return done.stdout


def test_train_step_runs_on_cpu(tmp_path):
    out = run("train_step.py", "--device", "cpu", "--steps", "3", "--warmup", "1",
              "--repeats", "1", "--json", str(tmp_path / "t.json"))
    assert "| fastfeed |" in out and "| stock |" in out and "| synthetic |" in out
    summary = json.loads((tmp_path / "t.json").read_text())["summary"]
    assert set(summary) == {"fastfeed", "stock", "synthetic"}
    assert all(0 <= s["stall_pct"] <= 100 for s in summary.values())


def test_overhead_quick(tmp_path):
    out = run("overhead.py", "--quick", "--samples", "512", "--json", str(tmp_path / "o.json"))
    rows = json.loads((tmp_path / "o.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["ratio"] > 0
    assert "| uint8 | 128 |" in out


def test_overhead_cold_with_its_bound(tmp_path):
    out = run("overhead.py", "--cold", "--cold-gb", "0.05", "--repeats", "1",
              "--json", str(tmp_path / "c.json"))
    figures = json.loads((tmp_path / "c.json").read_text())
    assert figures["medians"]["fastfeed"] > 0 and figures["bounds"]["two_processes"] > 0
    assert "% of best bound" in out and "| fastfeed |" in out


def test_overhead_cold_profile():
    out = run("overhead.py", "--cold", "--profile", "--cold-gb", "0.05", "--repeats", "1")
    assert "main process" in out and "collate" in out


def test_autotune_io_rows(tmp_path):
    out = run("autotune.py", "--kinds", "io", "--batches", "12", "--measure", "4",
              "--repeats", "1", "--json", str(tmp_path / "a.json"))
    assert "| io |" in out and "first epoch of 10 batches" in out


@pytest.mark.clients
def test_ultralytics_profile_on_fewer_images_than_it_profiles(tmp_path):
    # 24 images, while the profile indexes 220 samples: indices must wrap, not raise IndexError.
    pytest.importorskip("ultralytics")
    env = dict(os.environ, FASTFEED_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ultralytics_pipeline.py"),
                          "--profile", "--images", "24", "--widths", "160,200", "--imgsz", "64"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "stock:" in out.stdout and "imdecode ms per image" in out.stdout


@pytest.mark.clients
def test_torchvision_pipeline_leaves_out_a_peer_that_is_not_installed(tmp_path):
    pytest.importorskip("torchvision")
    from fastfeed.vision.synthetic import make_imagefolder

    folder = make_imagefolder(tmp_path / "imgs", images=16, classes=2)
    out = run("torchvision_pipeline.py", "--data", str(folder), "--configs", "stock,dali-cpu",
              "--peers-python", str(tmp_path / "no-such-python"), "--repeats", "1",
              "--epochs", "1", "--batch-size", "8")
    assert "dali-cpu: not installed" in out and "| stock |" in out
    assert "| dali-cpu |" not in out


@pytest.mark.clients
def test_short_epochs_compares_short_with_long_in_one_run(tmp_path):
    pytest.importorskip("torchvision")
    env = dict(os.environ, FASTFEED_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "short_epochs.py"),
                          "--images", "24", "--short", "8", "--batch-size", "4", "--repeats", "1",
                          "--epochs", "1", "--json", str(tmp_path / "s.json")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| fastfeed-2w | short |" in out.stdout and "of the long ratio" in out.stdout
    rates = json.loads((tmp_path / "s.json").read_text())["rates"]
    assert set(rates) == {"stock@short", "fastfeed-2w@short", "stock@long", "fastfeed-2w@long"}


@pytest.mark.clients
def test_accelerate_pixels_tabulates_each_size(tmp_path):
    pytest.importorskip("torchvision")
    from fastfeed.vision.synthetic import make_imagefolder

    folder = make_imagefolder(tmp_path / "imgs", images=4, classes=1)
    out = run("accelerate_pixels.py", "--data", str(folder), "--sizes", "32,16", "--seeds", "2")
    assert "| 32 |" in out and "| 16 |" in out


@pytest.mark.clients
def test_torchvision_train_runs_on_cpu(tmp_path):
    # The GPU suite's training loop, as a smoke run: every feed that needs no CUDA, a row
    # each; the cuda-only ones left out with a note.
    pytest.importorskip("torchvision")
    out = run("torchvision_train.py", "--device", "cpu", "--model", "tiny", "--images", "32",
              "--workers", "2", "--warmup", "1", "--steps", "2", "--json", str(tmp_path / "t.json"))
    assert "gpu-decode: needs CUDA, left out" in out and "| accelerate-device |" in out
    figures = json.loads((tmp_path / "t.json").read_text())
    rows = {row["feed"]: row for row in figures["rows"]}
    assert set(rows) == {"gpu-alone", "stock", "swap", "accelerate", "accelerate-device"}
    assert rows["stock"]["vs_stock"] == 1.0 and figures["device"] == "CPU"
    assert all(0 <= row["wait_share"] <= 1 and row["gpu_busy"] is None for row in rows.values())


@pytest.mark.clients
def test_gpu_decode_pixels_tabulates_both_routes():
    pytest.importorskip("torchvision")
    out = run("gpu_decode_pixels.py", "--images", "4", "--seeds", "1", "--size", "32")
    assert "| gpu-decode |" in out and "| cpu route |" in out


def test_pin_ahead_runs_on_cpu():
    """The cost of next() with pin_memory=True, against the stock loader, with the stand-in
    copy: neither loader copies in next()."""
    out = run("pin_ahead.py", "--rounds", "1", "--batches", "4", "--warmup", "1",
              "--step-ms", "20", "--batch-size", "2")
    assert "| stock |" in out and "| fastfeed |" in out
    assert out.count("| 0 of ") == 2
