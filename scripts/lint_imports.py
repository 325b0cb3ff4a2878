"""Check the import-layering contract (``[tool.importlinter]`` in pyproject.toml) against the source tree.

Why a mirror: our directories map to ``kvpool.<dir>`` through setuptools' ``package-dir`` (the user's card
keeps ``prefill/``, ``decode/``, ``kvstore/`` ... at the top level), but import-linter finds a package's
modules by walking the directory of ``kvpool/__init__.py``. So the tree is copied into a temporary
``kvpool/<dir>/`` layout (source files only, a few MB) and the contract is checked there.
Exit status is lint-imports'.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_mirror(dest: Path) -> None:
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, directory in sorted(mapping.items(), key=lambda kv: kv[0].count(".")):
        target = dest.joinpath(*package.split("."))
        shutil.copytree(
            ROOT / directory, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "data")
        )


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvpool-imports-") as tmp:
        build_mirror(Path(tmp))
        env = {**os.environ, "PYTHONPATH": tmp}
        lint = Path(sys.executable).with_name("lint-imports")
        cmd = [str(lint), "--config", str(ROOT / "pyproject.toml")]
        return subprocess.run(cmd, cwd=tmp, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
