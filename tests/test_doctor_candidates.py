"""What the doctor offers, and what it recommends: the option list and the recommendation rule
as functions of measurements, so that the GPU's options are decided on this CPU as they would
be on a GPU machine (a device is passed, never used: the configurations are built lazily).
The GPU time of an option is measured in its loader-alone runs, from a stand-in NVML reading
here.
"""

from __future__ import annotations

import torch
from sample_datasets import TensorDataset
from torch.utils.data import DataLoader

from fastfeed.doctor.candidates import configurations, gpu_routes
from fastfeed.doctor.findings import Option
from fastfeed.doctor.loaders import LoaderSpec
from fastfeed.doctor.recommend import recommend, training_bound
from fastfeed.doctor.trials import BASELINE, Config, TrialPlan, run_trials
from fastfeed.nvml import GpuSample

CUDA = torch.device("cuda", 0)


def spec(**arguments) -> LoaderSpec:
    return LoaderSpec.of(DataLoader(TensorDataset(16), batch_size=4, **arguments))


def keys(configs) -> list[str]:
    return [c.key for c in configs]


def test_without_a_gpu_the_gpu_options_are_named_and_not_measured():
    configs, unmeasured = configurations(spec(), [], None, None, 30, cuda=False)
    assert keys(configs) == [BASELINE, "swap"]
    (gpu,) = [u for u in unmeasured if "no GPU" in u.reason]
    assert gpu.change == 'device="cuda", pin_memory=True'


def test_a_script_training_on_the_cpu_of_a_gpu_machine_is_offered_no_gpu_option():
    configs, unmeasured = configurations(spec(), [], None, None, 30, cuda=True)
    assert keys(configs) == [BASELINE, "swap"] and unmeasured == []


def test_a_script_training_on_a_gpu_has_the_gpu_options_measured():
    configs, unmeasured = configurations(spec(), [], CUDA, None, 30, cuda=True)
    assert keys(configs) == [BASELINE, "swap", "device", "pin_memory"] and unmeasured == []
    assert not any(c.gpu_work for c in configs)  # copies only: no work taken from the model
    configs, _ = configurations(spec(pin_memory=True), [], CUDA, None, 30, cuda=True)
    assert keys(configs) == [BASELINE, "swap", "device"]


def test_gpu_routes_follow_the_pipeline():
    assert gpu_routes(False, False) == ['device="cuda", pin_memory=True']
    assert gpu_routes(True, False)[1] == 'accelerate(dataset, decode_device="cuda")'
    assert gpu_routes(False, True)[1] == 'fastfeed.ultralytics.patch(augment_device="cuda")'


def option(key: str, speedup: float, rate: float, gpu_ms: float | None = None,
           gpu_work: bool = False) -> Option:
    return Option(f"change {key}", speedup, None, rate, key, gpu_work=gpu_work,
                  gpu_ms_per_sample=gpu_ms)


def test_an_option_is_recommended_from_its_loader_alone_gain():
    yours = Option("", 1.0, True, 100.0, BASELINE)
    measured, chosen = recommend([yours, option("a", 1.5, 150), option("b", 1.05, 105),
                                  option("c", 2.0, 200)], consumer=90, model=1000)
    assert [o.key for o in chosen] == ["c", "a"]
    assert measured[0] is yours and all(o.training_speedup is None for o in measured)


def test_gpu_work_is_recommended_only_if_it_outweighs_its_share_of_the_gpu():
    # Training consumed 100 samples/s; its model step alone would take 400.
    costly = option("costly", 3.0, 300, gpu_ms=10.0, gpu_work=True)  # 1/(1/400 + 0.01) = 80
    cheap = option("cheap", 3.0, 300, gpu_ms=0.5, gpu_work=True)  # 1/(1/400 + 0.0005) = 333
    unknown = option("unknown", 3.0, 300, gpu_work=True)
    measured, chosen = recommend([costly, cheap, unknown], consumer=100, model=400)
    by_key = {o.key: o for o in measured}
    assert by_key["costly"].training_speedup == training_bound(300, 400, 0.010) / 100 < 1.1
    assert by_key["cheap"].training_speedup == 3.0  # the loader's own rate is the lower bound
    assert "training at most 0.80× faster" in by_key["costly"].note
    assert by_key["unknown"].training_speedup is None
    assert "not measured" in by_key["unknown"].note
    assert [o.key for o in chosen] == ["cheap", "unknown"]


class Reader:
    """A stand-in GPU reading: the utilisation set by the configuration being built."""

    busy = 0.0

    def reading(self, since: float, until: float | None = None) -> list[GpuSample]:
        return [GpuSample(0, "Stand-in GPU", self.busy, 0, 1)]


def test_the_gpu_time_an_option_adds_is_measured_against_the_scripts_loader():
    reader, loader = Reader(), spec()

    def building(busy: float):
        def build():
            reader.busy = busy
            return loader.build()
        return build

    configs = [Config(BASELINE, "", building(10.0)),
               Config("gpu", "change gpu", building(50.0), gpu_work=True),
               Config("copy", "change copy", building(50.0))]
    results = {r.key: r for r in run_trials(configs, TrialPlan(loader, 4, 5.0, 1, gpu=reader))}
    # Busy 50 % at its rate, less the script's loader's 10 % at its own: seconds per sample.
    expected = 1000 * (0.5 / results["gpu"].samples_per_s
                       - 0.1 / results[BASELINE].samples_per_s)
    assert results["gpu"].gpu_ms_per_sample is not None
    assert abs(results["gpu"].gpu_ms_per_sample - max(0.0, expected)) < 1e-6
    assert results["copy"].gpu_ms_per_sample is None and results[BASELINE].gpu_ms_per_sample is None
