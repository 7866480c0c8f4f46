import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from fastfeed._imports import importable
from fastfeed._install import install_line, torchvision_pin
from fastfeed.info import READY, collect, features
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
    assert printed["DALI"].startswith("not installed") != importable("nvidia.dali")
    for key, module in (("torchvision", "torchvision"), ("Ultralytics", "ultralytics")):
        unusable = printed[key] == "not installed" or printed[key].endswith("does not import here")
        assert unusable != importable(module), key
    assert printed["JPEG window decoder"] == describe()
    assert printed["GPU JPEG decoder"] == jpeg_decoders.describe()
    assert printed["CPUs (affinity)"] == str(len(os.sched_getaffinity(0)))
    assert printed["shared-memory slots"] == "memfd"  # Linux
    for key in ("fastfeed", "numpy", "Pillow", "YOLO warp kernel", "YOLO HSV kernel",
                "YOLO shared cache", "crop-window draws", "CUDA", "GPU", "NVML",
                "Ultralytics", "/dev/shm"):
        assert printed[key], key


def test_nvml_fails_soft():
    facts = collect()
    if not torch.cuda.is_available():
        # a reason, not an exception, where there is no GPU
        assert facts["NVML"].startswith("unavailable (") and facts["GPU"] == "none"


@pytest.fixture
def modules_forgotten():
    """Whatever the test imports is forgotten after it: a namespace package imported from a
    test's folder would otherwise be what later tests of this process get for its name."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_info_says_what_each_feature_needs_and_the_line_that_brings_it(tmp_path, monkeypatch,
                                                                       modules_forgotten):
    (tmp_path / "ray").mkdir()  # imports as a namespace package from here: not Ray
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = features()
    for feature, module in (("fastfeed.vision.accelerate", "torchvision"),
                            ("fastfeed.ultralytics.patch()", "ultralytics"),
                            ('worker_mode="ray"', "ray"),
                            ("charts (bench.png, doctor --out)", "matplotlib")):
        library = importable(module) and importlib.util.find_spec(module).origin is not None
        assert (found[feature] == READY) == library, feature
        if found[feature] != READY:
            # The package itself, never fastfeed's extra: fastfeed is not on the package index.
            assert ": pip install " in found[feature] and "fastfeed[" not in found[feature]
    if not importable("torchvision"):
        assert found["fastfeed.vision.accelerate"].endswith(install_line("torchvision"))


@pytest.mark.parametrize(("torch_version", "cuda", "line"), [
    ("2.14.1", "12.8", "pip install torchvision==0.29.1"),
    ("2.13.0+cpu", None,
     "pip install torchvision==0.28.0 --extra-index-url https://download.pytorch.org/whl/cpu"),
    ("2.11.0+cu126", "12.6",
     "pip install torchvision==0.26.0 --extra-index-url https://download.pytorch.org/whl/cu126"),
])
def test_torchvision_is_the_release_built_for_the_installed_torch(torch_version, cuda, line):
    assert install_line("torchvision", torch_version, cuda) == line


def test_lines_for_the_other_features():
    assert install_line("ultralytics", "2.14.1", "12.8") == (
        "pip install ultralytics torchvision==0.29.1")
    assert install_line("ultralytics", "2.14.1", "12.8", with_torchvision=False) == (
        "pip install ultralytics")
    assert install_line("ray") == "pip install 'ray>=2.40'"
    assert install_line("dali", cuda="13.0") == "pip install nvidia-dali-cuda130"
    assert install_line("dali", cuda="12.8") == "pip install nvidia-dali-cuda120"
    assert torchvision_pin("2.15.0a0+git1234") is None  # a source build: no known pair
    assert "the torchvision release built for your torch" in install_line(
        "torchvision", "2.15.0a0+git1234")
