import importlib.util
import os
import subprocess
import sys

import torch

from fastfeed._imports import importable
from fastfeed.info import collect


def test_info_reports_what_this_machine_has():
    out = subprocess.run([sys.executable, "-m", "fastfeed", "info"], capture_output=True,
                         text=True, check=True).stdout
    printed = dict(line.split(" : ", 1) for line in out.splitlines() if " : " in line)
    printed = {key.strip(): value.strip() for key, value in printed.items()}
    assert printed["torch"] == torch.__version__
    assert printed["C++ extension"] == ("loaded" if importable("fastfeed._gather")
                                        else "not built: pure-torch copy path")
    for key, distribution in (("DALI", "nvidia-dali-cuda120"), ("torchvision", "torchvision")):
        installed = importlib.util.find_spec(distribution.split("-")[0]) is not None
        assert printed[key].startswith("not installed") != installed, key
    assert printed["CPUs (affinity)"] == str(len(os.sched_getaffinity(0)))
    assert printed["ring"] == "memfd slots"  # Linux
    for key in ("fastfeed", "numpy", "Pillow", "YOLO warp kernel", "YOLO HSV kernel",
                "YOLO shared cache", "CUDA", "GPU", "NVML",
                "Ultralytics", "/dev/shm"):
        assert printed[key], key


def test_nvml_fails_soft():
    facts = collect()
    if not torch.cuda.is_available():
        # a reason, not an exception, where there is no GPU
        assert facts["NVML"].startswith("unavailable (") and facts["GPU"] == "none"
