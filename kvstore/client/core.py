"""The state every store-client call shares: the master link, the transports, counters, the
known-location cache behind direct reads and the use reporter.

``AsyncStoreClient`` (``async_client``) is this core plus its write path (``writes``) and read path
(``reads``); each path is a class over the same core so the three stay one object with one set of state.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvpool.kvstore.client.master_link import MasterLink
from kvpool.kvstore.client.touch import TouchReporter
from kvpool.kvstore.errors import StoreError
from kvpool.kvstore.transport.base import DEFAULT_DEADLINES, Deadlines
from kvpool.kvstore.transport.select import TransportSelector
from kvpool.proto import common_pb2, master_pb2

LOCATION_CACHE = 16_384  # keys whose last known location is remembered for direct reads (<1 KB each)
# A caller that wraps store calls in its own time budget (a worker's --store-timeout, the sync client's
# deadline_s) gives each master call this share of it: the call's own deadline then fires first, so the
# master link sees a silent master as a timeout and opens its breaker (master_link.py), instead of a
# cancellation it cannot tell from a caller going away.
RPC_SHARE_OF_BUDGET = 0.8
T = TypeVar("T")


class ClientCore:
    """Plumbing shared by the write and read paths; see ``AsyncStoreClient`` for the public API."""

    def __init__(
        self,
        master: str,
        transport: str = "auto",
        *,
        tenant: str = "",
        lease_ms: int = 10_000,
        rpc_timeout_s: float = 5.0,
        deadlines: Deadlines = DEFAULT_DEADLINES,
        master_wire: bool = True,
    ) -> None:
        self.master_address = master
        self.tenant = tenant
        self.lease_ms = lease_ms
        self.rpc_timeout_s = rpc_timeout_s
        self.transports = TransportSelector(transport, deadlines)
        self.master_wire = master_wire
        self._link: MasterLink | None = None
        self._counters: dict[str, float] = {}
        self._counters_lock = threading.Lock()
        self._pending_releases: set[asyncio.Task] = set()
        # key -> where this client last saw the object (its own puts, its lookups): lets a get start the
        # transfer while the master's Lookup is in flight (see _read_into)
        self._where: OrderedDict[bytes, common_pb2.ObjectLocation] = OrderedDict()
        self._last_put_node: common_pb2.NodeEndpoint | None = None  # where shm puts reserve speculatively
        self.leader_epoch = 0  # HA: the master leader's epoch as of this client's last PutStart (0 = no HA)
        self._touches: TouchReporter | None = None  # made on first use: it needs the running loop

    # --- plumbing ----------------------------------------------------------------------------------------
    @property
    def master(self) -> MasterLink:
        """The link to the master: its binary wire when the master advertises one, else gRPC."""
        if self._link is None:
            self._link = MasterLink(self.master_address, self.rpc_timeout_s, use_wire=self.master_wire)
        return self._link

    def _count(self, name: str, n: float = 1) -> None:
        with self._counters_lock:  # the sync client's same-host fast path counts from the caller's thread
            self._counters[name] = self._counters.get(name, 0) + n

    def metrics(self) -> dict[str, float]:
        """Counters: ops.*, failures.*, latency_s.* (sums), bytes_in.<transport>, bytes_out.<transport>,
        master.* (the master link's: grpc_calls, wire_calls, silent, failed_fast, ...)."""
        link = {f"master.{k}": float(v) for k, v in self._link.counters.items()} if self._link else {}
        return {**self._counters, **self.transports.metrics(), **link}

    def _meta(
        self, key: bytes, size: int, kind: int, tenant: str | None, parent: bytes, ttl_ms: int
    ) -> common_pb2.ObjectMeta:
        """A put's meta with its checksum left open (0): puts declare it at PutCommit, and the transport
        computes it on the way (``Transport.put``), the shm one while copying, in the same pass."""
        return common_pb2.ObjectMeta(
            key=bytes(key),
            kind=kind,
            size=size,
            tenant=self.tenant if tenant is None else tenant,
            parent=parent,
            ttl_ms=ttl_ms,
        )

    async def _timed(self, op: str, coro: Coroutine[Any, Any, T]) -> T:
        t0 = time.perf_counter()
        self._count(f"ops.{op}")
        try:
            return await coro
        except BaseException:
            self._count(f"failures.{op}")
            raise
        finally:
            self._count(f"latency_s.{op}", time.perf_counter() - t0)

    def _remember(self, loc: common_pb2.ObjectLocation) -> None:
        """Note where a key lives (called on the loop): later gets of it read straight from that node."""
        if self._touches is None:
            self._touches = TouchReporter(self._report_touches, asyncio.get_running_loop())
        where = self._where
        where[loc.meta.key] = loc
        where.move_to_end(loc.meta.key)
        if len(where) > LOCATION_CACHE:
            where.popitem(last=False)

    async def _report_touches(self, keys: list[bytes]) -> None:
        try:
            await self.master.lookup(master_pb2.LookupRequest(keys=keys, touch=True))
        except StoreError:
            self._count("failures.touch_report")
