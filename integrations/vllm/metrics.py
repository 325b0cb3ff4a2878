"""The connector's Prometheus counters, in the process's default registry (vLLM's ``/metrics`` serves it
when the engine runs in the API server's process; ``stats()`` gives the same numbers to callers)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from prometheus_client import Counter

_HELP = {
    "lookups": "prefix lookups the scheduler side asked the kvpool master",
    "lookup_errors": "lookups that failed or passed their deadline (counted as a miss)",
    "hit_tokens": "prompt tokens the connector offered vLLM from kvpool",
    "loaded_objects": "objects loaded into vLLM's KV cache",
    "load_errors": "objects that were missing, late or corrupt (vLLM recomputed their blocks)",
    "loaded_bytes": "bytes loaded from kvpool",
    "saved_objects": "objects saved to kvpool",
    "save_errors": "objects whose save failed (a future miss, never an error of the request)",
    "not_admitted": "objects the store declined to admit (its admission control)",
    "saved_bytes": "bytes saved to kvpool",
    "saves_dropped": "objects not saved because the save queue was full or shut down (a future miss)",
}


@dataclass(slots=True)
class ConnectorStats:
    lookups: int = 0
    lookup_errors: int = 0
    hit_tokens: int = 0
    loaded_objects: int = 0
    load_errors: int = 0
    loaded_bytes: int = 0
    saved_objects: int = 0
    save_errors: int = 0
    not_admitted: int = 0
    saved_bytes: int = 0
    saves_dropped: int = 0

    def add(self, field: str, n: int = 1) -> None:
        setattr(self, field, getattr(self, field) + n)
        _counter(field).inc(n)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


_COUNTERS: dict[str, Counter] = {}


def _counter(field: str) -> Counter:
    """One counter per field and process, however many connectors the process holds (registered once)."""
    c = _COUNTERS.get(field)
    if c is None:
        c = _COUNTERS[field] = Counter(f"kvpool_vllm_connector_{field}", _HELP[field])
    return c
