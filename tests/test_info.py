import subprocess
import sys

from fastfeed.info import collect


def test_info_runs_and_reports_everything():
    out = subprocess.run([sys.executable, "-m", "fastfeed", "info"], capture_output=True,
                         text=True, check=True).stdout
    for key in ("fastfeed", "torch", "numpy", "Pillow", "C++ extension", "YOLO warp kernel",
                "CUDA", "GPU", "NVML",
                "DALI", "torchvision", "Ultralytics", "CPUs (affinity)", "/dev/shm"):
        assert f"\n{key} " in "\n" + out, key


def test_nvml_fails_soft():
    facts = collect()
    assert facts["NVML"]  # a reason, not an exception, where there is no GPU
