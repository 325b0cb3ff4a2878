"""The launcher's configuration and run directories: the shipped defaults (``deploy/local.toml``), the one set
every ``Cluster`` starts from, merged with a user's TOML (``kvpool up --config``) and a caller's overrides,
and where runs keep their logs and ``state.json``."""

from __future__ import annotations

import getpass
import os
import tempfile
import tomllib
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "local.toml"


def runs_root() -> Path:
    """Where run dirs and ``current.json`` live: ``$KVPOOL_RUNS`` or ``<tmp>/kvpool-<user>``."""
    env = os.environ.get("KVPOOL_RUNS")
    return Path(env) if env else Path(tempfile.gettempdir()) / f"kvpool-{getpass.getuser()}"


def merge_config(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge_config(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> dict[str, Any]:
    """The TOML config (``deploy/local.toml`` by default; a user file is merged over it) plus overrides."""
    with DEFAULT_CONFIG.open("rb") as f:
        cfg = tomllib.load(f)
    if path is not None and Path(path).resolve() != DEFAULT_CONFIG:
        with Path(path).open("rb") as f:
            cfg = merge_config(cfg, tomllib.load(f))
    return merge_config(cfg, overrides or {})
