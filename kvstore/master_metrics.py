"""Prometheus text exposition of the master's Stats on ``GET /metrics`` (a tiny asyncio HTTP server).

Dependency-free on purpose: one read-only endpoint does not justify a web framework in the master. Served
from the master's event loop, so the numbers are a consistent snapshot of the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from kvpool.proto import master_pb2

log = logging.getLogger(__name__)
READ_TIMEOUT_S = 5.0

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
    lines += _family("info", "gauge", "configuration", [(f'policy="{_label(stats.policy)}"', 1)])
    return "\n".join(lines) + "\n"


class MetricsServer:
    """``GET /metrics`` -> :func:`render` of ``stats()``; anything else 404."""

    def __init__(self, stats: Callable[[], master_pb2.StatsReply], host: str, port: int) -> None:
        self._stats = stats
        self.host = host
        self.requested_port = port
        self.port = 0
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.requested_port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            parts = head.split(b" ", 2)
            if len(parts) >= 2 and parts[0] == b"GET" and parts[1].split(b"?")[0] == b"/metrics":
                body = render(self._stats()).encode()
                status, ctype = b"200 OK", b"text/plain; version=0.0.4; charset=utf-8"
            else:
                body, status, ctype = b"not found: try /metrics\n", b"404 Not Found", b"text/plain"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as exc:
            log.debug("metrics request dropped: %s", exc)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), READ_TIMEOUT_S)
