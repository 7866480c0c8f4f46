#!/usr/bin/env bash
# Everything that needs a GPU, for the lent GPU machine:
#   tests     the GPU-marked tests
#   overhead  benchmarks/overhead.py (adds H2D from the ring against the pinned peak)
#   train     benchmarks/train_step.py, ResNet-50 (bs 256, AMP, channels_last) and YOLO-like
#   images    benchmarks/images.py: nvjpeg against the CPU path at 16 workers
#   yolo      the batch pixel ops of fastfeed.ultralytics' augment_device on the GPU and, where
#             Ultralytics and OpenCV are installed, its YOLO loader: stock, patched, augment_device
#   yolo_train  where Ultralytics is installed: yolov8n training, images/s and data stall
# With no arguments it runs all six (about 20 minutes on an H100); name stages to split the
# work across device calls: bash benchmarks/gpu_suite.sh tests overhead
# Logs and JSON go under $OUT when it is set (the device tool), else benchmarks/out/.
# The GPU machine cannot download: the extension is built with the pybind11 and setuptools
# already installed there (--no-build-isolation), against its own torch. Ultralytics is not
# installed there (its OpenCV is); wheels in .whl/ (carried, git-ignored) are installed first:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       ultralytics==8.4.190 ultralytics-thop==2.2.3
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
stages=("${@:-tests overhead train images yolo yolo_train}")
stages=(${stages[*]})

python3 -m pip install -q --no-build-isolation --no-deps -e . >"$out/install.log" 2>&1 \
    || echo "install failed (see install.log); running from the source tree" | tee -a "$out/install.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        >"$out/wheels.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

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
        *) echo "unknown stage $stage (tests, overhead, train, images, yolo, yolo_train)"
           status=2 ;;
    esac
done
exit $status
