"""``fastfeed doctor`` on client libraries' training runs: torchvision pipelines (``Compose`` v1
and v2, each transform named), a Lightning ``fit``, an Ultralytics ``model.train``, and the
Ultralytics options measured on an Ultralytics loader.

Needs the client environment: ``.venv-clients/bin/python -m pytest -m clients
tests/test_doctor*.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.clients, pytest.mark.timeout(300)]

SCRIPTS = Path(__file__).parent / "doctor_scripts"
QUICK = ["--repeats", "1", "--trial-batches", "4", "--trial-seconds", "2"]


def diagnose(tmp_path: Path, *args: str) -> tuple[dict, subprocess.CompletedProcess[str]]:
    out = tmp_path / "d.json"
    run = subprocess.run([sys.executable, "-m", "fastfeed", "doctor", *QUICK, "--json", str(out),
                          *args], capture_output=True, text=True, timeout=280,
                         env={**os.environ, "YOLO_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return json.loads(out.read_text()), run


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_torchvision_transforms_are_named_and_accelerate_is_measured(tmp_path, version):
    # One worker and a 40 ms transform: 320 ms of data per batch, against a CPU training step
    # that a busy 2-core machine stretches past 100 ms.
    pytest.importorskip("torchvision")
    found, _ = diagnose(tmp_path, "--warmup", "2", "--batches", "5",
                        str(SCRIPTS / "train_classifier.py"), "--transforms", version,
                        "--slow-ms", "40", "--workers", "1", "--generate", "64",
                        "--batch-size", "8", "--size", "64")
    stages = [s["stage"] for s in found["per_sample_ms"]]
    assert stages[0] == "Sleep", stages
    converted = ["ToTensor"] if version == "v1" else ["ToImage", "ToDtype"]
    assert {"RandomResizedCrop", "RandomHorizontalFlip", "Normalize", *converted,
            "open + decode (default_loader)", "file read", "collate"} <= set(stages)
    assert found["loader"]["dataset"] == "torchvision.datasets.folder.ImageFolder"
    assert found["verdict"] == "data-bound"
    measured = {o["key"]: o for o in found["measured"]}
    assert measured["accelerate"]["samples_per_s"] > 0
    assert measured["accelerate"]["same_batches"] is not True  # pixels within a few levels
    assert any(u["change"] == "pip install pillow-simd" for u in found["unmeasured"])


def test_lightning_fit_is_diagnosed_on_its_training_loader(tmp_path):
    pytest.importorskip("lightning")
    found, run = diagnose(tmp_path, "--warmup", "2", "--batches", "5",
                          str(SCRIPTS / "train_lightning.py"))
    # The sanity check iterated the validation loader (batch 4) first; the window is the
    # training loader's.
    assert found["loader"]["batch_size"] == 8
    assert found["other_loaders"] == [
        {"class": "torch.utils.data.dataloader.DataLoader", "batches": 2}]
    assert found["verdict"] == "data-bound"
    assert found["per_sample_ms"][0]["stage"] == "__getitem__"
    assert "DATA-BOUND" in run.stdout


def test_ultralytics_training_is_diagnosed_by_stage(tmp_path):
    pytest.importorskip("ultralytics")
    found, run = diagnose(tmp_path, "--warmup", "1", "--batches", "3",
                          str(SCRIPTS / "train_yolo.py"))
    assert found["loader"]["class"] == "ultralytics.data.build.InfiniteDataLoader"
    assert found["loader"]["num_workers"] == 2
    stages = {s["stage"] for s in found["per_sample_ms"]}
    why = (found.get("stages_ruled_out"), found.get("notes"))  # a failure says which it was
    assert {"load_image (read, decode, resize)", "Mosaic", "RandomPerspective", "RandomHSV",
            "RandomFlip", "Format", "file read"} <= stages, why
    assert found["verdict"] in ("data-bound", "compute-bound", "balanced")
    assert "processes running" not in run.stdout


def test_ultralytics_options_are_measured_on_its_loader(tmp_path):
    pytest.importorskip("ultralytics")
    import fastfeed.ultralytics as fu
    from fastfeed.doctor.candidates import configurations
    from fastfeed.doctor.loaders import LoaderSpec
    from fastfeed.doctor.trials import TrialPlan, run_trials

    loader = yolo_loader(tmp_path)
    spec = LoaderSpec.of(loader)
    configs, _ = configurations(spec, [], None, None, 4)
    assert [c.key for c in configs] == ["yours", "patch", "fast_decode"]
    results = {r.key: r for r in run_trials(configs, TrialPlan(spec, 4, 5.0, 2))}
    assert not fu.is_patched()  # each patched run gives Ultralytics back its own code
    assert all(r.samples_per_s > 0 and not r.error for r in results.values())
    assert results["patch"].same_batches is True  # patch() keeps Ultralytics' batches
    loader.close()


def classic_folder(tmp_path: Path):
    from torchvision import datasets
    from torchvision import transforms as T

    from fastfeed.vision.synthetic import make_imagefolder

    root = make_imagefolder(tmp_path / "folder", images=8, classes=2)
    return datasets.ImageFolder(str(root), transform=T.Compose([
        T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.ToTensor()]))


def test_gpu_decode_is_offered_on_a_gpu_and_named_without_one(tmp_path):
    pytest.importorskip("torchvision")
    import torch
    from torch.utils.data import DataLoader

    from fastfeed.doctor.candidates import configurations
    from fastfeed.doctor.loaders import LoaderSpec

    spec = LoaderSpec.of(DataLoader(classic_folder(tmp_path), batch_size=4))
    configs, unmeasured = configurations(spec, [], torch.device("cuda", 0), None, 4, cuda=True)
    assert [c.key for c in configs] == ["yours", "swap", "accelerate", "device", "pin_memory",
                                        "gpu_decode"]
    assert [c.key for c in configs if c.gpu_work] == ["gpu_decode"]
    assert 'decode_device="cuda"' in configs[-1].change and unmeasured[:1] == []
    configs, unmeasured = configurations(spec, [], None, None, 4, cuda=False)
    assert "gpu_decode" not in [c.key for c in configs]
    (gpu,) = [u for u in unmeasured if "no GPU" in u.reason]
    assert 'accelerate(dataset, decode_device="cuda")' in gpu.change


def yolo_loader(tmp_path: Path):
    from ultralytics.cfg import get_cfg
    from ultralytics.data import build_dataloader, build_yolo_dataset
    from ultralytics.utils import DEFAULT_CFG

    from fastfeed.vision.synthetic import make_yolo

    root = make_yolo(tmp_path / "yolo", images=16)
    data = {"names": {i: f"c{i}" for i in range(8)}, "nc": 8, "channels": 3}
    dataset = build_yolo_dataset(get_cfg(DEFAULT_CFG, {"imgsz": 64}), str(root / "images"), 4,
                                 data, mode="train")
    return build_dataloader(dataset, 4, 2, shuffle=True, rank=-1)


def test_augment_device_is_offered_on_a_gpu_only(tmp_path):
    pytest.importorskip("ultralytics")
    import torch

    from fastfeed.doctor.candidates import configurations
    from fastfeed.doctor.loaders import LoaderSpec

    loader = yolo_loader(tmp_path)
    spec = LoaderSpec.of(loader)
    configs, _ = configurations(spec, [], torch.device("cuda", 0), None, 4, cuda=True)
    assert [c.key for c in configs] == ["yours", "patch", "fast_decode", "device", "pin_memory",
                                        "augment_device"]
    assert [c.key for c in configs if c.gpu_work] == ["augment_device"]
    configs, unmeasured = configurations(spec, [], None, None, 4, cuda=False)
    assert [c.key for c in configs] == ["yours", "patch", "fast_decode"]
    (gpu,) = [u for u in unmeasured if "no GPU" in u.reason]
    assert 'patch(augment_device="cuda")' in gpu.change
    loader.close()


@pytest.mark.gpu
@pytest.mark.parametrize(("script", "args", "key"), [
    ("train_classifier.py", ["--device", "cuda", "--workers", "2", "--generate", "256",
                             "--batch-size", "32", "--arch", "resnet18"], "gpu_decode"),
    ("train_yolo.py", ["--device", "0", "--images", "64", "--batch", "8", "--imgsz", "320"],
     "augment_device"),
], ids=["gpu_decode", "augment_device"])
def test_the_gpu_routes_are_measured_on_a_gpu(tmp_path, script, args, key):
    found, _ = diagnose(tmp_path, "--warmup", "2", "--batches", "10", str(SCRIPTS / script),
                        *args)
    if found["verdict"] == "compute-bound":
        pytest.skip("the loader is not the bottleneck here: no option is measured")
    measured = {o["key"]: o for o in found["measured"]}
    assert key in measured, found["unmeasured"]
    option = measured[key]
    assert option["gpu_work"] and option["samples_per_s"] > 0
    recommended = {o["key"] for o in found["recommendations"]}
    if option["training_speedup"] is not None:  # NVML measured its GPU time
        assert option["gpu_ms_per_sample"] >= 0
        assert (key in recommended) == (option["speedup"] >= 1.1
                                        and option["training_speedup"] >= 1.1)
