"""fla-core's pure-torch KDA reference (``fla/ops/kda/naive.py``), our independent oracle on CPU.

Loaded by file path: importing the ``fla`` package pulls in its Triton kernels, which need triton (absent
from the CPU venv); ``naive.py`` itself needs only torch and einops.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest


def load_fla_naive() -> ModuleType:
    """The module, or a pytest skip when fla-core is not installed."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core not installed")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "kda" / "naive.py"
    if not path.exists():
        pytest.skip(f"{path} missing")
    s = importlib.util.spec_from_file_location("fla_kda_naive", path)
    assert s is not None and s.loader is not None
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod
