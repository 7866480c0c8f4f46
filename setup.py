"""Builds fastfeed's optional C++ extensions.

Both are plain C++ with pybind11: neither needs torch nor CUDA at build time.

- ``fastfeed._C``: the gather kernels that copy samples into ring slots.
- ``fastfeed._jpeg``: region-of-interest JPEG decoding, built when libjpeg-turbo's headers are
  present (Debian: libjpeg-dev).

Both are ``optional``: without a compiler (or libjpeg) the install still finishes, and
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


def _extension(name: str, source: str, **kwargs) -> Pybind11Extension:
    ext = Pybind11Extension(name, [source], cxx_std=17, extra_compile_args=["-O3"], **kwargs)
    ext.optional = True
    return ext


extensions = [_extension("fastfeed._C", "csrc/gather.cpp")]
if _has_libjpeg():
    extensions.append(_extension("fastfeed._jpeg", "csrc/jpeg_crop.cpp", libraries=["jpeg"]))

setup(ext_modules=extensions, cmdclass={"build_ext": build_ext})
