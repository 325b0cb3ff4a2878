"""kvpool's store as the shared KV tier behind vLLM (KV connector v1): ``KvpoolConnector``.

Loaded by vLLM from ``KVTransferConfig(kv_connector="KvpoolConnector",
kv_connector_module_path="kvpool.integrations.vllm", ...)``. The connector class imports vLLM; the other
modules of this package (chunk keys, transfer plans, the object codec) do not, so they can be read and
tested on their own. Mechanism: ``docs/design/vllm_connector.md``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvpoolConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvpoolConnector":  # imported on first use: vLLM is only needed by the connector itself
        from .connector import KvpoolConnector

        return KvpoolConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
