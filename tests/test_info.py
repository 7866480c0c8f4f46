import os
import subprocess
import sys

import torch

from fastfeed._imports import importable
from fastfeed.info import collect
from fastfeed.vision import jpeg_decoders
from fastfeed.vision.libjpeg import describe


def test_info_reports_what_this_machine_has():
    out = subprocess.run([sys.executable, "-m", "fastfeed", "info"], capture_output=True,
                         text=True, check=True).stdout
    printed = dict(line.split(" : ", 1) for line in out.splitlines() if " : " in line)
    printed = {key.strip(): value.strip() for key, value in printed.items()}
    assert printed["torch"] == torch.__version__
    assert printed["C++ extension"] == ("loaded" if importable("fastfeed._gather")
                                        else "not built: pure-torch copy path")
    # Whether each imports here (CUDA builds of torch install an `nvidia` namespace of their own).
    for key, module in (("DALI", "nvidia.dali"), ("torchvision", "torchvision")):
        assert printed[key].startswith("not installed") != importable(module), key
    assert printed["JPEG window decoder"] == describe()
    assert printed["GPU JPEG decoder"] == jpeg_decoders.describe()
    assert printed["CPUs (affinity)"] == str(len(os.sched_getaffinity(0)))
    assert printed["shared-memory slots"] == "memfd"  # Linux
    for key in ("fastfeed", "numpy", "Pillow", "YOLO warp kernel", "YOLO HSV kernel",
                "YOLO shared cache", "CUDA", "GPU", "NVML",
                "Ultralytics", "/dev/shm"):
        assert printed[key], key


def test_nvml_fails_soft():
    facts = collect()
    if not torch.cuda.is_available():
        # a reason, not an exception, where there is no GPU
        assert facts["NVML"].startswith("unavailable (") and facts["GPU"] == "none"
