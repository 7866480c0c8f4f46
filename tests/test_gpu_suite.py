"""benchmarks/gpu_suite.sh's last table (benchmarks/gpu_figures.py), from the files its stages
leave: each stage's outcome, pytest's counts where it ran pytest, and the figures of the JSON."""

import importlib.util
import json
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_figures.py"
_spec = importlib.util.spec_from_file_location("gpu_figures", _SCRIPT)
gpu_figures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_figures)


def test_the_table_reads_every_stage_and_every_figure(tmp_path):
    (tmp_path / "stages.tsv").write_text("build\t0\t21\ngpu_tests\t0\t40\nsuite\t124\t170\n"
                                         "yolo_ops\t1\t9\n")
    (tmp_path / "gpu_tests.log").write_text("...\n=== 23 passed, 2 skipped in 38.1s ===\n")
    (tmp_path / "suite.log").write_text("[gw1] PASSED a\n=== 1 failed, 410 passed in 169.0s ===")
    (tmp_path / "yolo_ops.log").write_text("Traceback ...\n")
    (tmp_path / "yolo_train.json").write_text(json.dumps({
        "runs": {"stock": [{"images_per_s": 1.0, "stall": 0.5}]},
        "medians": {"stock": {"images_per_s": 286.2, "stall": 0.004},
                    "patched": {"images_per_s": 240.0, "stall": 0.12}}}))
    (tmp_path / "torchvision_train.json").write_text(json.dumps({
        "feeds": [{"feed": "stock", "images_per_s": 2400, "wait_share": 0.31, "gpu_busy": 64.0}]}))
    lines = gpu_figures.table(tmp_path).splitlines()
    assert "| gpu_tests | 23 passed, 2 skipped | 40 |" in lines
    assert "| suite | cut at its time limit, 1 failed, 410 passed before | 170 |" in lines
    assert "| yolo_ops | exit 1 | 9 |" in lines
    assert "| yolo_train stock | 286 | 0.4 % |  |" in lines  # the medians, not every run
    assert "| yolo_train patched | 240 | 12.0 % |  |" in lines
    assert "| torchvision_train feeds stock | 2,400 | 31.0 % | 64.0 % |" in lines
    assert sum("yolo_train" in line for line in lines) == 2
