"""Which GPU a process uses (fastfeed.which_gpu) and which one its NVML sampler reads."""

import sys
import time
import types

import pytest

from fastfeed.which_gpu import local_cuda_index, nvml_device_for


@pytest.mark.parametrize("local_rank", [None, "0", "3", "7"])
def test_one_visible_gpu_is_cuda0_whatever_local_rank_says(local_rank):
    # torchrun with CUDA_VISIBLE_DEVICES set per rank: every rank's GPU is its cuda:0.
    assert local_cuda_index(None, local_rank, visible_device_count=1, current_device=0) == 0


def test_several_visible_gpus_follow_local_rank():
    assert local_cuda_index(None, "2", visible_device_count=4, current_device=0) == 2
    assert local_cuda_index(None, " 3 ", visible_device_count=4, current_device=0) == 3


def test_a_device_the_script_set_wins_over_local_rank():
    # torch.cuda.set_device(2) in a rank torchrun numbered 0 (a rank that drives another GPU
    # than its number, or a script that maps ranks to GPUs itself): its batches go to GPU 2.
    assert local_cuda_index(None, "0", visible_device_count=4, current_device=2) == 2
    assert local_cuda_index(None, "3", visible_device_count=4, current_device=1) == 1


def test_without_local_rank_the_current_device_decides():
    assert local_cuda_index(None, None, visible_device_count=4, current_device=1) == 1
    assert local_cuda_index(None, "", visible_device_count=4, current_device=2) == 2


def test_an_explicit_index_wins_over_local_rank():
    assert local_cuda_index(1, "3", visible_device_count=4, current_device=0) == 1
    assert local_cuda_index(0, "3", visible_device_count=1, current_device=0) == 0


@pytest.mark.parametrize("local_rank", ["4", "-1"])
def test_local_rank_beyond_the_visible_gpus_is_a_clear_error(local_rank):
    with pytest.raises(ValueError, match=f"LOCAL_RANK={local_rank} but this process sees 4"):
        local_cuda_index(None, local_rank, visible_device_count=4, current_device=0)


def test_bad_requests_are_clear_errors():
    with pytest.raises(ValueError, match="not an integer"):
        local_cuda_index(None, "rank0", visible_device_count=2, current_device=0)
    with pytest.raises(ValueError, match="cuda:2 was requested but this process sees 2"):
        local_cuda_index(2, None, visible_device_count=2, current_device=0)
    with pytest.raises(ValueError, match="no CUDA device"):
        local_cuda_index(None, "0", visible_device_count=0, current_device=0)


def test_nvml_device_follows_cuda_visible_devices():
    assert nvml_device_for(1, None) == 1  # nothing hidden: same numbering
    assert nvml_device_for(0, "3") == 3
    assert nvml_device_for(1, "2, 0") == 0
    uuid = "GPU-8f6c1e2a-0c2b-4f3e-9a3d-5a0b7c1d2e3f"
    assert nvml_device_for(0, f"{uuid},1") == uuid
    assert nvml_device_for(0, "MIG-4a2b") == "MIG-4a2b"


def test_nvml_device_list_ends_at_an_invalid_entry_as_in_cuda():
    assert nvml_device_for(0, "1,foo,2") == 1
    with pytest.raises(ValueError, match="not among CUDA_VISIBLE_DEVICES"):
        nvml_device_for(1, "1,foo,2")
    with pytest.raises(ValueError, match="0 visible"):
        nvml_device_for(0, "")


def fake_pynvml(uuids):
    """A pynvml stand-in for a machine whose GPUs have these UUIDs, recording what is read."""
    module = types.ModuleType("pynvml")
    module.read = []

    def utilization(handle):
        module.read.append(handle)
        return types.SimpleNamespace(gpu=10.0 * (handle + 1))

    module.nvmlInit = lambda: None
    module.nvmlSystemGetDriverVersion = lambda: "555.0"
    module.nvmlDeviceGetCount = lambda: len(uuids)
    module.nvmlDeviceGetHandleByIndex = lambda index: index
    module.nvmlDeviceGetIndex = lambda handle: handle
    module.nvmlDeviceGetUUID = lambda handle: uuids[handle]
    module.nvmlDeviceGetName = lambda handle: f"GPU {handle}"
    module.nvmlDeviceGetUtilizationRates = utilization
    module.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=handle, total=99)
    return module


@pytest.mark.parametrize("visible, cuda_index, nvml_index", [
    ("2,0", 0, 2), ("2,0", 1, 0), (None, 1, 1), ("GPU-cc", 0, 2)])
def test_gpu_sampler_reads_only_this_process_gpu(monkeypatch, visible, cuda_index, nvml_index):
    from fastfeed.gpu_sampler import GpuSampler

    nvml = fake_pynvml(["GPU-aa11", "GPU-bb22", "GPU-cc33", "GPU-dd44"])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    sampler = GpuSampler(cuda_index, interval=0.001)
    assert sampler.status == "ok"
    nvml.read.clear()  # the status check reads every GPU once, as `fastfeed info` does
    sampler.start()
    deadline = time.monotonic() + 10
    while len(nvml.read) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    sampler._thread.join()
    assert set(nvml.read) == {nvml_index}
    (gpu,) = sampler.since_start()
    assert gpu.index == nvml_index and gpu.utilization == 10.0 * (nvml_index + 1)


def test_gpu_sampler_names_an_unknown_uuid(monkeypatch):
    from fastfeed.gpu_sampler import GpuSampler

    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(["GPU-aa11"]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ff")
    sampler = GpuSampler(0)
    assert "GPU-ff" in sampler.status and sampler.since_start() == []
