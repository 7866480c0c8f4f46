"""Builds fastfeed's optional C++ extensions.

All are plain C++ with pybind11: none needs torch nor CUDA at build time.

- ``fastfeed._gather``: the gather kernels that copy samples into ring slots.
- ``fastfeed._warp``: OpenCV's bilinear warp for scale-and-translate matrices, separably
  (Ultralytics' default random perspective).
- ``fastfeed._hsv``: Ultralytics' HSV jitter (OpenCV's BGR->HSV, a lookup, HSV->BGR) in one pass.
- ``fastfeed._flags``: release/acquire flags for the Ultralytics image cache shared by processes.
- ``fastfeed._mt19937``: the next words of a torch CPU generator, from the bytes of its state
  (torchvision's crop windows drawn without a torch op per number).
- ``fastfeed._jpeg``: region-of-interest JPEG decoding, built when libjpeg-turbo's headers are
  present (Debian: libjpeg-dev). It links the static ``libjpeg.a`` installed with those headers
  where there is one, so that the library is the one the headers describe; else ``-ljpeg``,
  whose match with the headers fastfeed checks at import (a mismatch crashed decoders).
  ``FASTFEED_LIBJPEG=PREFIX`` builds it from ``PREFIX/include`` and ``PREFIX/lib/libjpeg.a``
  instead of the system's (``benchmarks/gpu_carry.sh`` carries such a prefix).

All are ``optional``: without a compiler (or libjpeg) the install still finishes, and
fastfeed uses its pure-Python paths (``python -m fastfeed info`` says which are active).
"""

import os
import shutil
import subprocess
import sys
import sysconfig

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError


def _libjpeg() -> tuple[str, str | None] | None:
    """The folder of ``jpeglib.h`` and the static ``libjpeg.a`` installed with it (or ``None``),
    or ``None`` where there are no headers."""
    if os.environ.get("FASTFEED_NO_JPEG"):
        return None
    chosen = os.environ.get("FASTFEED_LIBJPEG")
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    for prefix in [chosen] if chosen else ["/usr", "/usr/local", "/opt/homebrew"]:
        include = os.path.join(prefix, "include")
        if os.path.exists(os.path.join(include, "jpeglib.h")):
            archives = [os.path.join(prefix, lib, "libjpeg.a")
                        for lib in (os.path.join("lib", multiarch), "lib64", "lib")]
            return include, next((a for a in archives if os.path.exists(a)), None)
    return None


class BuildExt(build_ext):
    """Links ``fastfeed._jpeg`` with the static ``libjpeg.a`` found beside its headers, where it
    can, and with ``-ljpeg`` otherwise."""

    def build_extension(self, ext: Pybind11Extension) -> None:
        archive = getattr(ext, "static_libjpeg", None)
        if archive is None:
            return super().build_extension(ext)
        shared = (list(ext.libraries), list(ext.define_macros), list(ext.extra_link_args))
        try:
            ext.extra_objects = [self._relocatable(archive)]
            ext.libraries = []
            ext.define_macros.append(("FASTFEED_JPEG_STATIC", "1"))
            # Its symbols stay inside the module (Pillow loads a libjpeg of its own).
            ext.extra_link_args.append("-Wl,--exclude-libs,ALL")
            return super().build_extension(ext)
        except (CCompilerError, CompileError, ExecError, LinkError, OSError,
                subprocess.CalledProcessError) as error:
            print(f"fastfeed._jpeg: cannot link {archive} ({error}); linking -ljpeg, whose "
                  "match with the headers is checked at import", file=sys.stderr)
        ext.extra_objects = []
        ext.libraries, ext.define_macros, ext.extra_link_args = shared
        return super().build_extension(ext)

    def _relocatable(self, archive: str) -> str:
        """A copy of ``archive`` whose reference to libc's ``stderr`` is renamed to a pointer
        the module defines: distributions build libjpeg.a for executables (PIE, not PIC), and
        that one reference to libc's data is all that cannot go into a shared object."""
        objcopy = shutil.which("objcopy")
        if objcopy is None or not sys.platform.startswith("linux"):
            raise OSError("needs GNU objcopy on Linux")
        os.makedirs(self.build_temp, exist_ok=True)
        copy = os.path.join(self.build_temp, "libjpeg-fastfeed.a")
        subprocess.run([objcopy, "--redefine-sym", "stderr=fastfeed_jpeg_stderr", archive, copy],
                       check=True)
        return copy


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
               flags=("-ffp-contract=off", "-fno-math-errno", "-Wno-maybe-uninitialized",
                      "-Wno-psabi")),
    _extension("fastfeed._flags", "csrc/shared_flags.cpp"),
    _extension("fastfeed._mt19937", "csrc/torch_mt19937.cpp", flags=("-ffp-contract=off",)),
]
libjpeg = _libjpeg()
if libjpeg is not None:
    include, archive = libjpeg
    system = include == "/usr/include"  # the compiler's own folders
    jpeg = _extension("fastfeed._jpeg", "csrc/jpeg_crop.cpp", libraries=["jpeg"],
                      include_dirs=[] if system else [include],
                      library_dirs=[] if system else [os.path.join(include, "..", "lib")])
    jpeg.static_libjpeg = archive
    extensions.append(jpeg)

setup(ext_modules=extensions, cmdclass={"build_ext": BuildExt})
