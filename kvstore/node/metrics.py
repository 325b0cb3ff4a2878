"""Prometheus ``/metrics`` for a storage node (served by ``kvpool.runtime.metrics_http``).

Served from the process's own event loop (like the master's ``master_metrics``): the node's object table is
read at scrape time on the loop that mutates it, so every scrape is a consistent snapshot and no lock is
needed. Each process renders its own ``CollectorRegistry`` (never prometheus_client's global default), so
tests that run several services in one interpreter do not mix their series.

Per-transport bytes: the data servers and the gRPC control plane see the store through a ``TransportTap``
(a thin proxy over ``ObjectStore``) that attributes landed puts and served reads to the transport that
carried them: ``tcp`` / ``ucx`` frames, and ``shm`` for reserve+seal puts and located extents
(the reader copies a located extent out of the shared segment itself; the node counts the bytes it handed
out).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)
READ_TIMEOUT_S = 5.0
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


# -- storage node -----------------------------------------------------------------------------------------
class TransportBytes:
    """Bytes and objects moved per (transport, direction), filled by the ``TransportTap`` proxies."""

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], int] = {}
        self.objects: dict[tuple[str, str], int] = {}

    def add(self, transport: str, direction: str, size: int) -> None:
        k = (transport, direction)
        self.bytes[k] = self.bytes.get(k, 0) + size
        self.objects[k] = self.objects.get(k, 0) + 1


class TransportTap:
    """Delegates everything to the wrapped ``ObjectStore``; counts what ``transport`` carried.

    ``finish_put`` / ``read`` are the frame transport's own puts and gets; ``seal`` (a non-aborted shm
    reservation) and ``locate`` are the shm path. Internal calls of the store (``seal`` -> ``finish_put``)
    reach the real store, so nothing is counted twice.
    """

    def __init__(self, store, transport: str, counts: TransportBytes) -> None:  # type: ignore[no-untyped-def]
        self._store = store
        self._transport = transport
        self._counts = counts

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._store, name)

    def finish_put(self, pending) -> None:  # type: ignore[no-untyped-def]
        before = self._store.counters.get("puts", 0)
        self._store.finish_put(pending)
        if self._store.counters.get("puts", 0) > before:  # landed (not a duplicate)
            self._counts.add(self._transport, "in", pending.meta.size)

    async def read(self, obj, verify: bool = True):  # type: ignore[no-untyped-def]
        data = await self._store.read(obj, verify)
        self._counts.add(self._transport, "out", obj.meta.size)
        return data

    def seal(self, put_id: str, abort: bool, checksum: int = 0) -> None:
        pending = self._store.pending.get(put_id)
        before = self._store.counters.get("puts", 0)
        self._store.seal(put_id, abort, checksum)
        if pending is not None and not abort and self._store.counters.get("puts", 0) > before:
            self._counts.add("shm", "in", pending.meta.size)

    async def locate(self, key: bytes):  # type: ignore[no-untyped-def]
        extent = await self._store.locate(key)
        self._counts.add("shm", "out", extent.size)
        return extent


class NodeCollector(Collector):
    """Reads the node's ``ObjectStore`` at scrape time (on the node's loop)."""

    def __init__(self, store, counts: TransportBytes, node_id: Callable[[], str]) -> None:  # type: ignore[no-untyped-def]
        self.store = store
        self.counts = counts
        self.node_id = node_id

    def describe(self) -> Iterator:  # no up-front describe: the collector is only ever scraped live
        return iter(())

    def collect(self) -> Iterator:
        s = self.store
        alloc = s.pool.allocator
        counters = dict(s.counters)
        n = "kvpool_node_"

        def gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(n + name, help_, value=value)

        def counter(name: str, help_: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(n + name, help_, value=value)

        yield gauge("dram_used_bytes", "DRAM pool bytes allocated", alloc.used_bytes)
        yield gauge("dram_capacity_bytes", "DRAM pool size", alloc.capacity)
        yield gauge("ssd_used_bytes", "SSD tier bytes used (writes in flight included)", s.ssd_used)
        yield gauge("ssd_capacity_bytes", "SSD tier size (0 = no SSD tier)", s.ssd_capacity)
        yield gauge(
            "fragmentation", "DRAM free-space fragmentation (0 = one free extent)", alloc.fragmentation
        )
        objects = GaugeMetricFamily(n + "objects", "objects held, by tier", labels=["tier"])
        dram = sum(1 for o in list(s.objects.values()) if o.extent is not None)
        objects.add_metric(["dram"], dram)
        objects.add_metric(["ssd"], len(s.objects) - dram)
        yield objects
        yield gauge("pending_puts", "shm put reservations not yet sealed", len(s.pending))
        moved = CounterMetricFamily(
            n + "transport_bytes",
            "object bytes moved, by transport and direction",
            labels=["transport", "direction"],
        )
        ops = CounterMetricFamily(
            n + "transport_objects",
            "objects moved, by transport and direction",
            labels=["transport", "direction"],
        )
        for (transport, direction), v in sorted(dict(self.counts.bytes).items()):
            moved.add_metric([transport, direction], v)
        for (transport, direction), v in sorted(dict(self.counts.objects).items()):
            ops.add_metric([transport, direction], v)
        yield moved
        yield ops
        yield counter("bytes_in", "object bytes landed (every transport)", counters.get("bytes_in", 0))
        yield counter("bytes_out", "object bytes served by tcp/ucx reads", counters.get("bytes_out", 0))
        failures = CounterMetricFamily(
            n + "checksum_failures", "payloads that failed their checksum on the node", labels=["where"]
        )
        failures.add_metric(["put"], counters.get("puts_checksum_rejected", 0))
        failures.add_metric(["read"], counters.get("reads_corrupt", 0))
        yield failures
        yield counter("demotions", "objects moved DRAM -> SSD", counters.get("demotes", 0))
        yield counter("promotions", "objects moved SSD -> DRAM", counters.get("promotes", 0))
        events = CounterMetricFamily(n + "events", "the node's own event counters", labels=["event"])
        for name, v in sorted(counters.items()):
            events.add_metric([name], v)
        yield events
        yield _info(n + "info", self.node_id())


def _info(name: str, node_id: str) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, "node identity", labels=["node_id"])
    g.add_metric([node_id], 1)
    return g


def node_registry(store, counts: TransportBytes, node_id: Callable[[], str]) -> CollectorRegistry:  # type: ignore[no-untyped-def]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(store, counts, node_id))
    return registry
