"""Builds the optional ``fastfeed._C`` extension.

The extension is plain C++ (pybind11): it needs neither torch nor CUDA at build time. If the
compiler is missing, ``optional=True`` lets the install finish, and fastfeed uses its
pure-Python copy path instead (``python -m fastfeed info`` says which one is active).
"""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext = Pybind11Extension(
    "fastfeed._C",
    ["csrc/gather.cpp"],
    cxx_std=17,
    extra_compile_args=["-O3"],
)
ext.optional = True

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
