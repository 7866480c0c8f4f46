#!/usr/bin/env bash
# Everything that needs a GPU, for a fresh GPU machine with nothing but this repository:
#   tests     the GPU-marked tests (among them a dataclass batch with device="cuda")
#   pinned    ring slots of a CUDA loader are page-locked (cudaPointerGetAttributes)
#   dali      DALI on the GPU: tests/test_dali.py, its GPU tests included (whole epochs after a
#             break among them; needs DALI)
#   nvjpeg    the nvjpeg backend's GPU tests: greyscale JPEGs, a PNG named .JPEG and a CMYK
#             JPEG among them (needs torchvision)
#   overhead  benchmarks/overhead.py (adds H2D from the ring against the pinned peak)
#   train     benchmarks/train_step.py, ResNet-50 (bs 256, AMP, channels_last) and YOLO-like
#   images    benchmarks/images.py: nvjpeg against the CPU path at 16 workers
#   yolo      the batch pixel ops of fastfeed.ultralytics' augment_device on the GPU and, where
#             Ultralytics and OpenCV are installed, its YOLO loader: stock, patched, augment_device
#   yolo_train  where Ultralytics is installed: yolov8n training, images/s and data stall
#   doctor    fastfeed doctor on a stock torchvision ResNet-50 script and, where Ultralytics is
#             installed, a stock YOLO training run (tests/doctor_scripts/): report and JSON each
# With no arguments it runs all of them (about 20 minutes on an H100); name stages to split the
# work across device calls: bash benchmarks/gpu_suite.sh tests pinned
# Logs and JSON go under $OUT when it is set (the device tool), else benchmarks/out/.
#
# Setup, before any stage; the script stops with exit 2 and says why where it cannot:
# - python3 must hold a torch that sees a GPU; that torch is never reinstalled (pip gets it as
#   a constraint).
# - setuptools, pybind11 and pytest are required; the extras (test, dali, torchvision) are
#   installed where pip can reach an index. A machine that cannot download uses what it has
#   plus wheels carried in .whl/ (git-ignored), e.g.
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#         ultralytics==8.4.190 ultralytics-thop==2.2.3
# - The C++ extensions are built in place against that python; one that does not build or
#   import stops the suite (exit 1): benchmarks without them would measure the fallbacks.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
stages=("${@:-tests pinned dali nvjpeg overhead train images yolo yolo_train doctor}")
stages=(${stages[*]})

die() {  # die CODE MESSAGE: stop the suite with a reason
    echo "gpu_suite: $2" | tee -a "$out/setup.log" >&2
    exit "$1"
}
has() { python3 -c "import $1" >/dev/null 2>&1; }
pip_quiet() { python3 -m pip install -q --retries 0 --timeout 15 "$@" >>"$out/setup.log" 2>&1; }

: >"$out/setup.log"
command -v python3 >/dev/null || die 2 "no python3 on PATH"
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>>"$out/setup.log" \
    || die 2 "python3's torch is missing or sees no GPU: nothing here can run"
torch_pin="$out/torch-constraint.txt"
python3 -c "import torch; print(f'torch=={torch.__version__}')" >"$torch_pin"

if compgen -G ".whl/*.whl" >/dev/null; then  # carried wheels first, no index needed
    pip_quiet --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The build tools first: the editable install below builds without isolation.
for module in setuptools pybind11 pytest; do
    has $module || pip_quiet -c "$torch_pin" $module \
        || die 2 "$module is missing and could not be installed: install it, or carry its wheel in .whl/"
done
# The extras, with the machine's torch held where it is; offline this fails and what is
# already installed is used.
pip_quiet --no-build-isolation -c "$torch_pin" -e ".[test,dali,torchvision]" \
    || echo "gpu_suite: pip could not install the extras (offline?): using what is installed" \
    | tee -a "$out/setup.log"

jpeg_headers() { compgen -G "/usr/include/jpeglib.h" >/dev/null || compgen -G "/usr/local/include/jpeglib.h" >/dev/null; }
if ! jpeg_headers && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q libjpeg-dev >>"$out/setup.log" 2>&1 || true
fi
python3 setup.py build_ext --inplace >"$out/build.log" 2>&1 \
    || die 1 "building the C++ extensions failed (see build.log)"
required=(fastfeed._gather fastfeed._warp)
if jpeg_headers; then
    required+=(fastfeed._jpeg)
else
    echo "gpu_suite: no libjpeg headers (apt-get install libjpeg-dev): fastfeed._jpeg is not" \
        "built, and the window-decode figures measure Pillow's fallback" | tee -a "$out/setup.log"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for module in "${required[@]}"; do
    python3 -c "import $module" >>"$out/build.log" 2>&1 \
        || die 1 "extension $module did not build or does not import (see build.log)"
done

ultralytics_missing=""
has_ultralytics() {  # else names the missing module: a dependency to carry in .whl/
    ultralytics_missing=$(python3 -c "import ultralytics, cv2" 2>&1) && return 0
    ultralytics_missing=$(tail -n 1 <<<"$ultralytics_missing")
    return 1
}

status=0
run() {  # run NAME CMD...: log to $out/NAME.log, keep going, remember failures
    local name=$1; shift
    echo "== $name: $*"
    "$@" >"$out/$name.log" 2>&1 || { status=1; echo "   FAILED (exit $?)"; }
    tail -n 15 "$out/$name.log"
}

python3 -m fastfeed info | tee "$out/info.txt"
for stage in "${stages[@]}"; do
    case $stage in
        tests) run gpu_tests python3 -m pytest -m gpu -v -p no:cacheprovider tests ;;
        pinned) run pinned python3 - <<'PY'
# The slots of a CUDA loader's ring must be page-locked: else every copy from them is a
# synchronous pageable copy. is_pinned() asks CUDA (cudaPointerGetAttributes) about the
# slot's own address, so a registration that failed quietly shows here.
import torch
from torch.utils.data import TensorDataset
from fastfeed import FastLoader

data = TensorDataset(torch.randn(64, 3, 64, 64), torch.arange(64))
loader = FastLoader(data, batch_size=8, num_workers=2, device="cuda")
checked = 0
for images, _ in loader:
    ring = loader._telemetry.ring
    slots = list(getattr(ring, "_slots", {}).values())
    assert slots, "no ring slots found (FastLoader's ring API changed: update this check)"
    for slot in slots:
        assert torch.from_numpy(slot.memory).is_pinned(), f"slot {slot.slot_id} is pageable"
        checked += 1
assert checked, "the loader yielded nothing"
print(f"page-locked: {checked} slot readings, all pinned")
PY
        ;;
        dali)
            if has nvidia.dali; then
                run dali python3 -m pytest -v -p no:cacheprovider tests/test_dali.py
            else
                echo "== dali: FAILED: NVIDIA DALI is not installed (pip install 'fastfeed[dali]' needs an index)"
                status=1
            fi ;;
        nvjpeg)
            if has torchvision; then
                run nvjpeg python3 -m pytest -v -p no:cacheprovider tests/test_nvjpeg.py \
                    "tests/test_vision.py::test_nvjpeg_backend_agrees_with_cpu"
            else
                echo "== nvjpeg: FAILED: torchvision is not installed"
                status=1
            fi ;;
        overhead) run overhead python3 benchmarks/overhead.py --repeats 3 \
                      --json "$out/overhead.json" ;;
        train)
            run train_resnet50 python3 benchmarks/train_step.py --model resnet50 \
                --json "$out/train_resnet50.json"
            run train_yolo python3 benchmarks/train_step.py --model yolo-like \
                --json "$out/train_yolo.json" ;;
        images) run images python3 benchmarks/images.py --workers 16 --repeats 3 \
                    --batch-size 128 --configs fastfeed fastfeed-threads fastfeed-nvjpeg \
                    --json "$out/images.json" ;;
        yolo)
            run yolo_ops python3 benchmarks/ultralytics_pipeline.py --ops-device cuda
            if has_ultralytics; then
                run yolo_pipeline python3 benchmarks/ultralytics_pipeline.py --workers 8 \
                    --configs stock,patched,patched-fast,patched-augment,patched-fast-augment \
                    --json "$out/yolo.json"
            else
                echo "== yolo_pipeline: skipped: $ultralytics_missing"
            fi ;;
        yolo_train)
            if has_ultralytics; then
                run yolo_train python3 benchmarks/yolo_train_stall.py --device 0 --workers 8 \
                    --json "$out/yolo_train.json"
            else
                echo "== yolo_train: skipped: $ultralytics_missing"
            fi ;;
        doctor)
            run doctor_resnet50 python3 -m fastfeed doctor --warmup 10 --batches 40 \
                --json "$out/doctor_resnet50.json" --out "$out/doctor_resnet50" \
                tests/doctor_scripts/train_classifier.py --arch resnet50 --device cuda \
                --generate 4096 --batch-size 64 --workers 8 --epochs 1
            if has_ultralytics; then
                run doctor_yolo python3 -m fastfeed doctor --warmup 10 --batches 40 \
                    --json "$out/doctor_yolo.json" --out "$out/doctor_yolo" \
                    tests/doctor_scripts/train_yolo.py --device 0 --imgsz 640 --batch 32 \
                    --workers 8 --images 1024 --epochs 2
            else
                echo "== doctor_yolo: skipped: $ultralytics_missing"
            fi ;;
        *) echo "unknown stage $stage (tests, pinned, dali, nvjpeg, overhead, train, images, yolo, yolo_train, doctor)"
           status=2 ;;
    esac
done
exit $status
