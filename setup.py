"""Builds fastfeed's optional C++ extensions.

All are plain C++ with pybind11: none needs torch nor CUDA at build time.

- ``fastfeed._C``: the gather kernels that copy samples into ring slots.
- ``fastfeed._warp``: OpenCV's bilinear warp for scale-and-translate matrices, separably
  (Ultralytics' default random perspective).
- ``fastfeed._hsv``: Ultralytics' HSV jitter (OpenCV's BGR->HSV, a lookup, HSV->BGR) in one pass.
- ``fastfeed._flags``: release/acquire flags for the Ultralytics image cache shared by processes.
- ``fastfeed._jpeg``: region-of-interest JPEG decoding, built when libjpeg-turbo's headers are
  present (Debian: libjpeg-dev).

All are ``optional``: without a compiler (or libjpeg) the install still finishes, and
fastfeed uses its pure-Python paths (``python -m fastfeed info`` says which are active).
"""

import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup


def _has_libjpeg() -> bool:
    if os.environ.get("FASTFEED_NO_JPEG"):
        return False
    return any(os.path.exists(os.path.join(d, "jpeglib.h"))
               for d in ("/usr/include", "/usr/local/include", "/opt/homebrew/include"))


def _extension(name: str, source: str, flags: tuple[str, ...] = (), **kwargs
               ) -> Pybind11Extension:
    ext = Pybind11Extension(name, [source], cxx_std=17, extra_compile_args=["-O3", *flags],
                            depends=["csrc/cpu_features.h"], **kwargs)
    ext.optional = True
    return ext


extensions = [
    _extension("fastfeed._gather", "csrc/gather.cpp"),
    # Unfused multiply-adds: the kernels must round as OpenCV's do (see the files' heads).
    # GCC 12 flags its own AVX-512 headers (their undefined registers) as maybe-uninitialized,
    # and the ABI of vector returns from the (always inlined) lane templates.
    _extension("fastfeed._warp", "csrc/axis_warp.cpp",
               flags=("-ffp-contract=off", "-fno-wrapv", "-fno-math-errno",
                      "-Wno-maybe-uninitialized")),
    _extension("fastfeed._hsv", "csrc/hsv_jitter.cpp",
               flags=("-ffp-contract=off", "-fno-math-errno", "-Wno-maybe-uninitialized", "-Wno-psabi")),
    _extension("fastfeed._flags", "csrc/shared_flags.cpp"),
]
if _has_libjpeg():
    extensions.append(_extension("fastfeed._jpeg", "csrc/jpeg_crop.cpp", libraries=["jpeg"]))

setup(ext_modules=extensions, cmdclass={"build_ext": build_ext})
