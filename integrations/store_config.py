"""The kvpool fields an engine's storage plug-in takes (SGLang HiCache's extra config, LMCache's L2 adapter
params), checked at engine start, and the store client they open.

Why shared: both engines hand the backend a JSON object of its own fields; the fields that reach the store
(where the master is, whose bytes, over which transport, how long a call may take) mean the same in each,
and a bad one must stop the engine at start with one error naming it, never serve with a broken tier.
Each backend names its own error class and the object the fields came in (``extra_config``,
``adapter_params``); fields of its own it checks itself.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpool.kvstore.client.sync_client import StoreClient

TRANSPORTS = ("auto", "tcp", "shm", "ucx")
# field -> what it holds (the error messages and the design notes quote these)
FIELDS = {
    "master": 'the kvpool master, "HOST:PORT" (an HA group "a,b", master shards "g0;g1"); required',
    "salt": "a string mixed into every key (tenant isolation); default '' (its own namespace)",
    "tenant": "the store tenant charged for the bytes (quotas); default: the store client's",
    "transport": "the data plane: auto | tcp | shm | ucx; default auto",
    "deadline_s": "the bound on every store call in seconds; default 5",
    "connect_timeout_s": "how long the start-up probe waits for the master (each RPC within 0.8 x "
    "deadline_s); default 5",
}
_HOST_PORT = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:(\d{1,5})$")

# (field, why) -> the backend's typed error
ConfigError = Callable[[str, str], Exception]


@dataclass(frozen=True, slots=True)
class StoreConfig:
    master: str
    salt: str = ""
    tenant: str | None = None
    transport: str = "auto"
    deadline_s: float = 5.0
    connect_timeout_s: float = 5.0


def parse_store_config(extra: Any, error: ConfigError, container: str) -> StoreConfig:
    """The kvpool fields of ``extra`` (the dict the engine parsed, or the JSON text itself); ``container``
    names the object they came in, for errors about the whole of it."""
    if isinstance(extra, str | bytes):
        try:
            extra = json.loads(extra)
        except ValueError as exc:
            raise error(container, f"malformed JSON ({exc})") from None
    if extra is None:
        raise error("master", f"missing: {FIELDS['master']}")
    if not isinstance(extra, dict):
        raise error(container, f"must be a JSON object, got {type(extra).__name__}")
    master = extra.get("master")
    if master is None:
        raise error("master", f"missing: {FIELDS['master']}")
    if not isinstance(master, str) or not master.strip():
        raise error("master", f"must be a non-empty string, got {master!r}")
    for addr in (a.strip() for group in master.split(";") for a in group.split(",")):
        m = _HOST_PORT.match(addr)
        if m is None or not 0 < int(m[1]) < 65536:
            raise error("master", f"{addr!r} is not HOST:PORT (in {master!r})")
    salt = extra.get("salt", "")
    if not isinstance(salt, str):
        raise error("salt", f"must be a string, got {type(salt).__name__} {salt!r}")
    tenant = extra.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise error("tenant", f"must be a string, got {type(tenant).__name__} {tenant!r}")
    transport = extra.get("transport", "auto")
    if transport not in TRANSPORTS:
        raise error("transport", f"must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    return StoreConfig(
        master=master.strip(),
        salt=salt,
        tenant=tenant,
        transport=transport,
        deadline_s=_seconds(extra, "deadline_s", 5.0, error),
        connect_timeout_s=_seconds(extra, "connect_timeout_s", 5.0, error),
    )


def _seconds(extra: dict, field: str, default: float, error: ConfigError) -> float:
    value = extra.get(field, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise error(field, f"must be a positive number of seconds, got {value!r}")
    return float(value)


def connect(config: StoreConfig, error: ConfigError) -> tuple[StoreClient, int]:
    """A store client, after one probe of the master (an unknown or dead address fails the start, naming
    the field); also the DRAM capacity of an average storage node (0 when the store has none yet)."""
    kwargs: dict[str, Any] = {"deadline_s": config.deadline_s}
    if config.tenant is not None:
        kwargs["tenant"] = config.tenant
    try:
        store = StoreClient(config.master, config.transport, **kwargs)
    except Exception as exc:
        raise error("master", f"cannot use {config.master!r}: {exc}") from None
    store.deadline_s = config.connect_timeout_s  # the probe's own bound, then every call's
    try:
        stats = store.stats()
    except Exception as exc:
        store.close()
        raise error(
            "master", f"no kvpool master answers at {config.master!r} ({type(exc).__name__}: {exc})"
        ) from None
    store.deadline_s = config.deadline_s
    per_node = stats.capacity_bytes // stats.nodes if stats.nodes else 0
    return store, per_node
