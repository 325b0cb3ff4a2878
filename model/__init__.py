"""kvpool.model: the hybrid KDA + MLA model (Kimi-Linear / K3 style) that prefill and decode nodes share.

Entry points: `load_model("tiny" | checkpoint_dir)` -> `HybridModel` with ``prefill`` (canonical 64-token
schedule, bit-exact resume from a `PrefixState`), ``decode_step`` (`DecodeState`), ``cache_schema`` and
``fingerprint``. See docs/design/model.md.

Names are resolved lazily (PEP 562) so that ``import kvpool.model.state`` stays light and no import cycle
with ``kvpool.cache`` can form.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelConfig": "config",
    "DecodeState": "decode_state",
    "ModelError": "errors",
    "ModelInputError": "errors",
    "ConfigError": "errors",
    "UnsupportedConfigError": "errors",
    "WeightsError": "errors",
    "HybridModel": "hybrid",
    "load_model": "loader",
    "PrefillResult": "prefill_result",
    "KDACheckpoint": "state",
    "KDALayerState": "state",
    "PrefixState": "state",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvpool.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
