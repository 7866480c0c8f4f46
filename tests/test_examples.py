"""The examples run on CPU with tiny generated data."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script, *args, **options):
    return subprocess.run([sys.executable, str(ROOT / "examples" / script), *args],
                          capture_output=True, text=True, timeout=600, **options)


def test_train_resnet_example():
    out = run("train_resnet.py", "--generate", "48", "--epochs", "1", "--batch-size", "8",
              "--size", "64", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert "epoch 0: loss" in out.stdout and "samples/s" in out.stdout


@pytest.mark.clients
def test_train_yolo_example_keeps_the_image_size_it_is_given(tmp_path):
    pytest.importorskip("ultralytics")
    # Ultralytics' settings, and the run it writes, in the test's folder.
    env = dict(os.environ, YOLO_CONFIG_DIR=str(tmp_path))
    out = run("train_yolo_ultralytics.py", "--epochs", "1", "--workers", "2", "--imgsz", "96",
              "--project", str(tmp_path / "runs"), cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert "generated 24-image YOLO set at imgsz 96" in out.stdout
    [trained] = [line for line in out.stdout.splitlines() if line.startswith("trained on ")]
    assert trained.endswith("FastLoader"), trained  # Ultralytics' InfiniteDataLoader's peer
