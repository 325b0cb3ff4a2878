"""Prometheus text exposition of the master's Stats (served by ``kvpool.runtime.metrics_http``).

Rendered from ``StatsReply`` on the master's event loop, so the numbers are a consistent snapshot of the
index.
"""

from __future__ import annotations

from kvpool.proto import master_pb2

_GAUGES = (
    ("objects", "objects indexed (committed)"),
    ("bytes", "bytes indexed, pending puts included"),
    ("capacity_bytes", "capacity of all registered nodes and tiers"),
    ("nodes", "registered storage nodes"),
    ("active_leases", "read-pin leases held"),
    ("pending_puts", "two-phase puts started, not yet committed"),
)
_COUNTERS = (
    ("evictions", "objects dropped by pressure"),
    ("evicted_bytes", "bytes dropped by pressure"),
    ("demotions", "objects moved DRAM -> SSD"),
    ("expired", "objects dropped by TTL"),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(name: str, kind: str, help_: str, samples: list[tuple[str, int]]) -> list[str]:
    """One metric family; ``samples`` are (label text without braces, value)."""
    out = [f"# HELP kvpool_master_{name} {help_}", f"# TYPE kvpool_master_{name} {kind}"]
    for labels, v in samples:
        out.append(f"kvpool_master_{name}{{{labels}}} {v}" if labels else f"kvpool_master_{name} {v}")
    return out


def render(stats: master_pb2.StatsReply) -> str:
    """Prometheus text format 0.0.4."""
    lines: list[str] = []
    for name, help_ in _GAUGES:
        lines += _family(name, "gauge", help_, [("", getattr(stats, name))])
    for name, help_ in _COUNTERS:
        lines += _family(f"{name}_total", "counter", help_, [("", getattr(stats, name))])
    by_tier = [(f'tier="{_label(t)}"', b) for t, b in sorted(stats.bytes_per_tier.items())]
    lines += _family("tier_bytes", "gauge", "bytes indexed per tier", by_tier)
    by_tenant = [(f'tenant="{_label(t)}"', b) for t, b in sorted(stats.bytes_per_tenant.items())]
    lines += _family("tenant_bytes", "gauge", "bytes indexed per tenant", by_tenant)
    events = [(f'event="{_label(e)}"', n) for e, n in sorted(stats.counters.items())]
    lines += _family("events_total", "counter", "master event counters", events)
    if stats.HasField("admission_rate"):
        lines += _family(
            "admission_rate",
            "gauge",
            "policy hybrid: share of new chains admitted (1 = all)",
            [("", stats.admission_rate)],  # type: ignore[list-item]
        )
    lines += _family("info", "gauge", "configuration", [(f'policy="{_label(stats.policy)}"', 1)])
    return "\n".join(lines) + "\n"
