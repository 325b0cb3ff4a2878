"""The kvpool fields of SGLang's ``--hicache-storage-backend-extra-config`` JSON, checked at engine start.

SGLang hands the parsed JSON to the backend as ``HiCacheStorageConfig.extra_config`` (a dict, also holding
SGLang's own fields: ``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, ...). The backend
reads only its own fields, the store's (``integrations/store_config.py``, shared with the LMCache adapter);
a bad one is one ``HiCacheConfigError`` naming it, raised from the backend's constructor, so the engine
refuses to start instead of serving with a broken tier.

No SGLang import here: the fields can be checked (and tested) without it.
"""

from __future__ import annotations

from typing import Any

from kvpool.integrations.store_config import StoreConfig, parse_store_config


class HiCacheConfigError(ValueError):
    """A kvpool field of the extra config is missing, of the wrong type or unusable; names the field."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"kvpool HiCache backend: extra_config field {field!r}: {why}")
        self.field = field


def parse_config(extra: Any) -> StoreConfig:
    """The kvpool fields of ``extra`` (the dict SGLang parsed, or the JSON text itself)."""
    return parse_store_config(extra, HiCacheConfigError, "extra_config")
