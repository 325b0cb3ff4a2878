"""The kvpool fields of SGLang's ``--hicache-storage-backend-extra-config`` JSON, checked at engine start.

SGLang hands the parsed JSON to the backend as ``HiCacheStorageConfig.extra_config`` (a dict, also holding
SGLang's own fields: ``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, ...). The backend
reads only its own fields, listed in ``FIELDS``; a bad one is one ``HiCacheConfigError`` naming it, raised
from the backend's constructor, so the engine refuses to start instead of serving with a broken tier.

No SGLang import here: the fields can be checked (and tested) without it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

TRANSPORTS = ("auto", "tcp", "shm", "ucx")
# field -> what it holds (the error messages and the design note quote these)
FIELDS = {
    "master": 'the kvpool master, "HOST:PORT" (an HA group "a,b", master shards "g0;g1"); required',
    "salt": "a string mixed into every key (tenant isolation); default '' (its own namespace)",
    "tenant": "the store tenant charged for the bytes (quotas); default: the store client's",
    "transport": "the data plane: auto | tcp | shm | ucx; default auto",
    "deadline_s": "the bound on every store call in seconds; default 5",
    "connect_timeout_s": "how long the start-up probe waits for the master; default 5",
}
_HOST_PORT = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:(\d{1,5})$")


class HiCacheConfigError(ValueError):
    """A kvpool field of the extra config is missing, of the wrong type or unusable; names the field."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"kvpool HiCache backend: extra_config field {field!r}: {why}")
        self.field = field


@dataclass(frozen=True, slots=True)
class HiCacheKvpoolConfig:
    master: str
    salt: str = ""
    tenant: str | None = None
    transport: str = "auto"
    deadline_s: float = 5.0
    connect_timeout_s: float = 5.0


def parse_config(extra: Any) -> HiCacheKvpoolConfig:
    """The kvpool fields of ``extra`` (the dict SGLang parsed, or the JSON text itself)."""
    if isinstance(extra, str | bytes):
        try:
            extra = json.loads(extra)
        except ValueError as exc:
            raise HiCacheConfigError("extra_config", f"malformed JSON ({exc})") from None
    if extra is None:
        raise HiCacheConfigError("master", f"missing: {FIELDS['master']}")
    if not isinstance(extra, dict):
        raise HiCacheConfigError("extra_config", f"must be a JSON object, got {type(extra).__name__}")
    master = extra.get("master")
    if master is None:
        raise HiCacheConfigError("master", f"missing: {FIELDS['master']}")
    if not isinstance(master, str) or not master.strip():
        raise HiCacheConfigError("master", f"must be a non-empty string, got {master!r}")
    for addr in (a.strip() for group in master.split(";") for a in group.split(",")):
        m = _HOST_PORT.match(addr)
        if m is None or not 0 < int(m[1]) < 65536:
            raise HiCacheConfigError("master", f"{addr!r} is not HOST:PORT (in {master!r})")
    salt = extra.get("salt", "")
    if not isinstance(salt, str):
        raise HiCacheConfigError("salt", f"must be a string, got {type(salt).__name__} {salt!r}")
    tenant = extra.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise HiCacheConfigError("tenant", f"must be a string, got {type(tenant).__name__} {tenant!r}")
    transport = extra.get("transport", "auto")
    if transport not in TRANSPORTS:
        raise HiCacheConfigError("transport", f"must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    return HiCacheKvpoolConfig(
        master=master.strip(),
        salt=salt,
        tenant=tenant,
        transport=transport,
        deadline_s=_seconds(extra, "deadline_s", 5.0),
        connect_timeout_s=_seconds(extra, "connect_timeout_s", 5.0),
    )


def _seconds(extra: dict, field: str, default: float) -> float:
    value = extra.get(field, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise HiCacheConfigError(field, f"must be a positive number of seconds, got {value!r}")
    return float(value)
