"""Run a GPU benchmark on the CPU model of CUDA (``tests/cuda_model``): the plumbing of
``benchmarks/gpu_suite.sh`` (``GPU_SUITE_PLUMBING=1``), so that the code a GPU call runs is run
in CI, on a machine without a GPU.

    python benchmarks/on_cuda_model.py benchmarks/gpu_paths.py --parts memory

The script runs as ``__main__`` in this process with ``torch.cuda`` the model's: two devices of
``FASTFEED_MODEL_GPU_MIB`` MiB each (default 1024), and the GPU JPEG decoders the model's
(torchvision's, unless ``FASTFEED_JPEG_DECODER`` names TorchCodec). Its figures are the
model's, never a GPU's. A child the script starts with :func:`python_command` runs on the model
too; processes forked meanwhile (DataLoader workers) get torch's own ``torch.cuda`` back.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parents[1] / "tests"
MODEL_VARIABLE = "FASTFEED_ON_CUDA_MODEL"  # set for the script: its children use the model too

__all__ = ["MODEL_VARIABLE", "python_command"]


def python_command() -> list[str]:
    """How to start another Python on the same machine: the model's where this one runs on it,
    else this interpreter."""
    if os.environ.get(MODEL_VARIABLE):
        return [sys.executable, __file__]
    return [sys.executable]


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.path.insert(0, str(_TESTS))
    import cuda_model
    import nvjpeg_model

    os.environ[MODEL_VARIABLE] = "1"
    memory = int(os.environ.get("FASTFEED_MODEL_GPU_MIB", "1024")) << 20
    patches = pytest.MonkeyPatch()
    gpu = cuda_model.install(patches, cuda_model.Gpu(memory, devices=2))
    nvjpeg_model.install(patches, gpu, os.environ.get("FASTFEED_JPEG_DECODER", "torchvision"))
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        gpu.run()  # what is still queued, before the model goes
        patches.undo()


if __name__ == "__main__":
    main()
