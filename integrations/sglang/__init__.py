"""kvpool's store as SGLang HiCache's storage tier: ``KvpoolHiCacheStorage`` (``hicache.py``).

Loaded by SGLang's dynamic storage backend (``module_path`` ``kvpool.integrations.sglang.hicache``,
``class_name`` ``KvpoolHiCacheStorage``). The backend class imports SGLang; the other modules of this package
(its config fields, keys and page codec) do not, so they can be read and tested on their own. Mechanism:
``docs/design/sglang_hicache.md``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvpoolHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KvpoolHiCacheStorage":  # imported on first use: SGLang is only needed by the backend itself
        from .hicache import KvpoolHiCacheStorage

        return KvpoolHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
