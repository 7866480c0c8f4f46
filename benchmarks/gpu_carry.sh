#!/usr/bin/env bash
# Prepares .whl/ (git-ignored, but it travels with the working tree to the device machine) for
# benchmarks/gpu_suite.sh on a GPU machine that cannot download anything. Run it here, where
# PyPI and Debian's libjpeg are reachable:
#   bash benchmarks/gpu_carry.sh [NAME==VERSION ...]
#
# - Wheels for CPython 3.12 on manylinux x86_64 (the GPU machine's Python), without their
#   dependencies: Ultralytics and ultralytics-thop (the GPU machine has torch, torchvision,
#   OpenCV, but not these), pytest-timeout (the suite's per-test timeout), and any NAME==VERSION
#   given. Not polars (a 54 MB wheel): benchmarks/yolo_train_stall.py trains without it. The GPU
#   decode uses TorchCodec where it imports: give the release built for the GPU machine's torch
#   (torchcodec==0.17.0 for torch 2.14) to measure it, else torchvision's decoder is measured.
# - .whl/libjpeg/: libjpeg-turbo's headers and the static libjpeg.a installed with them
#   (Debian: libjpeg62-turbo-dev). The GPU machine has a libjpeg.so.8 and no headers; setup.py
#   links this archive (FASTFEED_LIBJPEG), so fastfeed._jpeg meets no other libjpeg there.
#
# The working tree that travels is at most 64 MiB: the script says how much it comes to.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=(ultralytics==8.4.190 ultralytics-thop==2.2.3 pytest-timeout==2.4.0 "$@")
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "${wheels[@]}"

include=/usr/include
multiarch=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('MULTIARCH') or '')")
archive=/usr/lib/$multiarch/libjpeg.a
if [ ! -f "$include/jpeglib.h" ] || [ ! -f "$archive" ]; then
    echo "gpu_carry: no libjpeg headers with a static libjpeg.a here" \
        "(Debian: apt-get install libjpeg62-turbo-dev)" >&2
    exit 1
fi
rm -rf .whl/libjpeg && mkdir -p .whl/libjpeg/include .whl/libjpeg/lib
for header in jpeglib.h jmorecfg.h jerror.h; do
    cp "$include/$header" .whl/libjpeg/include/
done
# jconfig.h sits in the multiarch folder on Debian; beside jpeglib.h, it is found first.
cp "$(find "$include" -name jconfig.h -path "*$multiarch*" | head -n 1)" .whl/libjpeg/include/
cp "$archive" .whl/libjpeg/lib/

ls -l .whl
tracked=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- | tail -n 1 | cut -f 1)
carried=$(du -sb .whl | cut -f 1)
total=$(( tracked + carried ))
echo "gpu_carry: the tree that travels: $(( tracked >> 20 )) MiB tracked + $(( carried >> 20 ))" \
    "MiB in .whl/ = $(( total >> 20 )) MiB of 64"
(( total < 64 << 20 )) || { echo "gpu_carry: over 64 MiB: carry fewer wheels" >&2; exit 1; }
