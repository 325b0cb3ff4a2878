"""The compiled part of kvpool: the prefix index core (Cython over a C++ key table) and what it calls per
block of the default policy's learners, the recency guard, admission control and the return-time model's
tickets (Cython over C++); and the simulator's one-pass LRU stack (``workloads/lru_stack.pyx``) and hash-id
chains (``workloads/id_chains.pyx``, over its own SHA-256). Built from source by ``pip install .`` with the
machine's C++ compiler; everything else is pyproject.toml's."""

import shutil
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


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


class BuildExt(build_ext):
    """An editable install compiles in a temporary directory, so it never sees the modules an earlier
    editable install built next to their sources: the vLLM test venv's install (same interpreter, whose ABI
    tag the file name carries) compiled them all again, on ``make test``'s critical path. There, a module
    newer than its generated C++, its headers and this file (its flags) is copied instead. A wheel (``pip
    wheel .``, ``pip install .``) always compiles."""

    def build_extension(self, ext: Extension) -> None:
        target = Path(self.get_ext_fullpath(ext.name))
        beside = Path(ext.sources[0]).with_name(target.name)  # where an editable install put it
        if self.editable_mode and beside.is_file():
            built = beside.stat().st_mtime
            if all(Path(f).stat().st_mtime < built for f in [*ext.sources, *ext.depends, __file__]):
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(beside, target)
                return
        super().build_extension(ext)


# two at a time (cythonize's processes, build_ext's compiler jobs): make test builds them three times, on a
# 2-core box
setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=cythonize(
        EXTENSIONS,
        compiler_directives={"language_level": 3},
        include_path=["kvstore/index"],
        quiet=True,
        nthreads=2,
    ),
    options={"build_ext": {"parallel": 2}},
)
