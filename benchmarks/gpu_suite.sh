#!/usr/bin/env bash
# Everything that needs a GPU, in one call on the lent GPU machine:
#   GPU-marked tests, the overhead benchmark (with H2D figures), the training-step benchmark.
# Logs and JSON go under $OUT when it is set (the device tool), else benchmarks/out/.
# The GPU machine cannot download: it builds the extension with the pybind11 and setuptools
# already installed there (--no-build-isolation), against its own torch.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

python3 -m pip install -q --no-build-isolation --no-deps -e . >"$out/install.log" 2>&1 \
    || echo "install failed (see install.log); running from the source tree" | tee -a "$out/install.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

status=0
run() {  # run NAME CMD...: log to $out/NAME.log, keep going, remember failures
    local name=$1; shift
    echo "== $name: $*"
    "$@" >"$out/$name.log" 2>&1 || { status=1; echo "   FAILED (exit $?)"; }
    tail -n 15 "$out/$name.log"
}

run info python3 -m fastfeed info
run gpu_tests python3 -m pytest -m gpu -v -p no:cacheprovider tests
run overhead python3 benchmarks/overhead.py --repeats 3 --json "$out/overhead.json"
run train_resnet50 python3 benchmarks/train_step.py --model resnet50 --json "$out/train_resnet50.json"
run train_yolo python3 benchmarks/train_step.py --model yolo-like --json "$out/train_yolo.json"
exit $status
