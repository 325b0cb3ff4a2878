"""The compiled part of kvpool: the prefix index core (Cython over a C++ key table), built from source by
``pip install .`` with the machine's C++ compiler; everything else is pyproject.toml's."""

from Cython.Build import cythonize
from setuptools import Extension, setup

INDEX = Extension(
    "kvpool.kvstore.index.prefix_index",
    ["kvstore/index/prefix_index.pyx"],
    depends=["kvstore/index/key_table.h"],
    include_dirs=["kvstore/index"],
    language="c++",
    # -O1: as fast as -O2 on bench/index_core_bench.py (the per-block work is calls into Python's C API and
    # cache misses) and half the compile time, which make test pays three times (two venvs, the wheel test)
    extra_compile_args=["-std=c++17", "-O1", "-g0"],
)

setup(ext_modules=cythonize([INDEX], compiler_directives={"language_level": 3}, quiet=True))
