"""The master process's pieces, assembled: the wire listener (every master call), the node notifier and the
sweep loop.

A background task runs :meth:`MasterCore.sweep` (dead nodes, abandoned puts, lease/pin/TTL expiry) every
``sweep_interval_s``; with HA only while this master may act (``may_sweep``). The one listener is the master
wire (``wire_server``): its address is what everyone passes as ``--master``, and its ``Describe`` call is what
health probes ask. ``--metrics-port`` serves :meth:`MasterServer.metrics_text` (Prometheus text of the core's
Stats, rendered on the master's event loop, so the numbers are a consistent snapshot of the index).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvpool.kvstore.master.core import MasterConfig, MasterCore, NodeAction
from kvpool.kvstore.master.kv_event_publisher import KvEventPublisher
from kvpool.kvstore.master.kv_events_config import KvEventsConfig
from kvpool.kvstore.master.node_notifier import NodeNotifier
from kvpool.kvstore.master.wire_server import MasterWireServer
from kvpool.proto import master_pb2

log = logging.getLogger(__name__)

_GAUGES = (
    ("objects", "objects indexed (committed)"),
    ("bytes", "bytes indexed, pending puts included"),
    ("capacity_bytes", "capacity of all registered nodes and tiers"),
    ("nodes", "registered storage nodes"),
    ("active_leases", "read-pin leases held"),
    ("pending_puts", "two-phase puts started, not yet committed"),
    ("rss_bytes", "resident memory of the master process"),
    ("index_slots", "object slots the index has allocated"),
    ("max_objects", "the index's object cap (0 = none)"),
    ("pinned_bytes", "bytes held by soft pins (operators' and clients' retention)"),
    ("pin_budget_earned", "share of --pin-share clients' pins have earned by being read (0..1)"),
)
_COUNTERS = (
    ("evictions", "objects dropped by pressure"),
    ("evicted_bytes", "bytes dropped by pressure"),
    ("demotions", "objects moved DRAM -> SSD"),
    ("expired", "objects dropped by TTL"),
    ("pins_refused", "pins refused over the pin budget (--pin-share)"),
)


class MasterServer:
    """A running master: ``port = await server.start()`` ... ``await server.stop()``."""

    def __init__(
        self,
        config: MasterConfig | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        kv_events: KvEventsConfig | None = None,
    ) -> None:
        self.config = config or MasterConfig()
        self.host = host
        self.requested_port = port
        timeout_s = self.config.node_call_timeout_ms / 1000.0
        self.notifier = NodeNotifier(
            timeout_s, lambda name, n: self.core.count(name, n), self._on_missing, shard=self.config.shard
        )
        self.wire = MasterWireServer(MasterCore(self.config), self.notifier)
        # HA (``ha.HaMaster``): whether sweeps may act now
        self.may_sweep: Callable[[], bool] = lambda: True
        self.sweep_interval_s = self.config.sweep_ms / 1000.0
        self.port = 0
        self._sweeper: asyncio.Task[None] | None = None
        # --kv-events: the index's changes as vLLM KV events (docs/design/kv_events.md); None = off
        self.kv_events = KvEventPublisher(kv_events, self.config.shard) if kv_events is not None else None

    @property
    def core(self) -> MasterCore:
        """The core serving now (with HA, a new one per election)."""
        return self.wire.core

    def replace_core(self, core: MasterCore) -> None:
        """HA: serve from ``core`` from now on; the old one's state (and unsent node orders) is dropped."""
        self.core.take_actions()
        self.wire.core = core
        if self.kv_events is not None and self.kv_events.started:
            self.kv_events.attach(core)  # a new incarnation: consumers start over

    async def start(self) -> int:
        """Listen; returns the bound port (``port`` 0 picks a free one). Raises OSError (zmq.ZMQError for a
        KV-events address that cannot be bound)."""
        if self.kv_events is not None:
            self.kv_events.start(asyncio.get_running_loop())
            self.kv_events.attach(self.core)
        self.port = await self.wire.start(self.host, self.requested_port)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())
        log.info("master serving on %s:%d (policy %s)", self.host, self.port, self.config.policy)
        return self.port

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        await self.wire.close()
        await self.notifier.idle(timeout_s=grace_s)
        await self.notifier.close()
        if self.kv_events is not None:
            await self.kv_events.close()

    def metrics_text(self) -> bytes:
        """The core's Stats as Prometheus text (format 0.0.4)."""
        return _prometheus_text(self.core.stats()).encode()

    def _on_missing(self, node_id: str, action: NodeAction, keys: list[bytes]) -> None:
        self.core.node_could_not(node_id, action, keys)
        self.wire.flush()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            if not self.may_sweep():  # an HA standby, or a leader not sure it still leads: act on nothing
                continue
            try:
                self.core.sweep()
                self.wire.flush()
            except Exception:  # keep sweeping: one bad pass must not stop dead-node detection
                log.exception("master sweep failed")
                self.core.count("sweep_errors")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(name: str, kind: str, help_: str, samples: list[tuple[str, int]]) -> list[str]:
    """One metric family; ``samples`` are (label text without braces, value)."""
    out = [f"# HELP kvpool_master_{name} {help_}", f"# TYPE kvpool_master_{name} {kind}"]
    for labels, v in samples:
        out.append(f"kvpool_master_{name}{{{labels}}} {v}" if labels else f"kvpool_master_{name} {v}")
    return out


def _prometheus_text(stats: master_pb2.StatsReply) -> str:
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
