"""The compiled part of kvpool: the prefix index core (Cython over a C++ key table) and what it calls per
block of the default policy's learners, the recency guard, admission control and the return-time model's
tickets (Cython over C++); and the simulator's one-pass LRU stack (``workloads/lru_stack.pyx``) and hash-id
chains (``workloads/id_chains.pyx``, over its own SHA-256). Built from source by ``pip install .`` with the
machine's C++ compiler; everything else is pyproject.toml's."""

from Cython.Build import cythonize
from setuptools import Extension, setup


def compiled(module: str, headers: list[str], package: str = "kvstore/index") -> Extension:
    """``<package>/<module>.pyx`` as ``kvpool.<package as a dotted path>.<module>``, depending on its headers
    there."""
    return Extension(
        f"kvpool.{package.replace('/', '.')}.{module}",
        [f"{package}/{module}.pyx"],
        depends=[f"{package}/{h}" for h in headers],
        include_dirs=[package],
        language="c++",
        # -O1: as fast as -O2 on bench/index_core_bench.py (the per-block work is calls into Python's C API
        # and cache misses) and half the compile time, which make test pays three times (two venvs, the
        # wheel test)
        extra_compile_args=["-std=c++17", "-O1", "-g0"],
    )


EXTENSIONS = [
    compiled("prefix_index", ["key_table.h", "lru_keys.h", "lru_keys.pxd", "recency_guard.h", "admission.h"]),
    compiled("recency_guard", ["key_table.h", "lru_keys.h", "lru_keys.pxd", "recency_guard.h"]),
    compiled("admission", ["key_table.h", "lru_keys.h", "lru_keys.pxd", "admission.h"]),
    compiled("lru_map", ["key_table.h", "lru_keys.h", "lru_keys.pxd"]),
    compiled("lru_stack", [], package="workloads"),
    compiled("id_chains", ["sha256.h"], package="workloads"),
]

# two at a time (cythonize's processes, build_ext's compiler jobs): make test builds them three times, on a
# 2-core box
setup(
    ext_modules=cythonize(
        EXTENSIONS,
        compiler_directives={"language_level": 3},
        include_path=["kvstore/index"],
        quiet=True,
        nthreads=2,
    ),
    options={"build_ext": {"parallel": 2}},
)
