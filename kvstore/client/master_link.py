"""``MasterLink``: the one object a store client talks to the master through.

``await link.call("Lookup", request)`` sends the call over the master wire (``master_wire``: ~0.1 ms per
round trip instead of gRPC's 0.45-0.8 ms) when the master advertises one and the wire carries that rpc,
otherwise over gRPC; either way failures are the same typed errors (``client_rpc.typed_error_from``), so it
is a drop-in for ``await stub.Name(request, timeout=rpc_timeout_s)`` + ``raise_typed``.

Discovery: one ``Describe`` over gRPC, lazily on the first wire-able call; the wire host is the host part
of the address the link was given (what the client can reach), the port is the advertised ``wire_port``. A
master without ``Describe`` (older) or with the wire off (``wire_port`` 0) is used over gRPC only.

When the wire fails:

* the connection could not be opened (``WireConnectError``): nothing was sent, so the call goes over gRPC
  whatever it is (this is also how a restarted master on a new wire port is survived). Calls then stay on
  gRPC for a backoff (1 s, doubling to 30 s while the wire keeps failing) before ``Describe`` is asked
  again, so a wire port the client cannot reach (a Service without it, a firewall) costs one connect
  timeout per backoff, not one per call;
* the connection broke with the call in flight: the master may or may not have run it. Only idempotent
  reads (:data:`RETRY_OVER_GRPC`) are retried, once, over gRPC. (With ``acquire=true`` a Lookup or
  MatchPrefix the master did run holds a second lease nobody releases; it ends at its deadline,
  ``lease_ms``, so the cost is objects protected from eviction a little longer, never a wrong answer.)
  ``PutStart``/``PutCommit`` (and every other write) raise ``StoreUnavailableError`` instead: a silent
  retry could start a second put of the key (reserving bytes on a node until its deadline) or commit a
  put the first attempt already committed or that the sweep meanwhile aborted, and the caller's own
  retry/abort logic must see that it happened;
* a deadline passed (``TransportTimeoutError``): raised, never retried (the call's time is spent).

Every wait is bounded by ``rpc_timeout_s`` per call, retry included (the retry gets what is left).

A silent master (partitioned, frozen): a refused connection fails fast by itself, but silence costs each
call its whole deadline, and a worker makes several per request. So a call that runs to its deadline opens a
breaker: calls raise ``MasterSilentError`` at once (counted as ``failed_fast``) while a background probe
(``Describe``, one per ``SILENT_BACKOFF_S`` step: 0.2 s doubling to 2 s) asks the master; its first answer
closes the breaker. No request's call is ever the probe, so no request waits out a deadline a second time.
The callers already treat any store error as a miss (recompute) or a failed put (counted), so during a
master partition requests cost their compute, not n deadlines.

HA (``address`` lists the group's masters, ``"a:1,b:2"``): a standby answers ``NotLeaderError`` having run
nothing, so the link moves to the leader it named and sends the call once more within the same deadline. A
master that cannot be reached or lets a call time out is left for the next one on the following call, and the
breaker's probe walks the list until a leader answers. No etcd client is needed to follow a failover.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from google.protobuf.message import Message
from kvpool.kvstore.client.master_wire import MasterWireClient
from kvpool.kvstore.errors import (
    MasterSilentError,
    NotLeaderError,
    StoreError,
    StoreUnavailableError,
    TransportTimeoutError,
)
from kvpool.kvstore.protocol.grpc_errors import CHANNEL_OPTIONS, raise_typed
from kvpool.kvstore.protocol.master_addresses import MasterAddresses
from kvpool.kvstore.protocol.master_wire import METHODS as WIRE_METHODS
from kvpool.kvstore.protocol.master_wire import WireConnectError
from kvpool.proto import master_pb2, master_pb2_grpc
from kvpool.runtime import cluster_auth

# Read-only calls a second execution cannot harm: retried over gRPC when the wire breaks mid-call.
RETRY_OVER_GRPC = frozenset({"Lookup", "MatchPrefix", "Stats", "Describe"})
MIN_RETRY_S = 0.05  # a retry with less time left than this is not worth starting
WIRE_BACKOFF_S = (1.0, 30.0)  # gRPC only for this long after the wire could not be reached (doubling)
SILENT_BACKOFF_S = (0.2, 2.0)  # the breaker's probe: first after 0.2 s, then doubling up to 2 s


def host_of(address: str) -> str:
    """The host part of ``host:port`` (``[v6]:port`` too; grpc ``dns:``/``ipv4:`` prefixes dropped)."""
    target = address.split("///")[-1]
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        target = target.removeprefix(scheme)
    host, sep, _port = target.rpartition(":")
    if not sep:
        return target
    return host.strip("[]")


class MasterLink:
    """See the module docstring. Use from one event loop; ``await link.close()`` when done."""

    def __init__(
        self,
        address: str,
        rpc_timeout_s: float = 5.0,
        use_wire: bool = True,
        *,
        connect_timeout_s: float = 1.0,
    ) -> None:
        self.masters = MasterAddresses(address)
        self.rpc_timeout_s = rpc_timeout_s
        self.use_wire = use_wire
        self.connect_timeout_s = connect_timeout_s
        self.counters: dict[str, int] = {}
        self._channel: grpc.aio.Channel | None = None
        self._stub: master_pb2_grpc.MasterStub | None = None
        self._wire: MasterWireClient | None = None
        self._wire_methods: frozenset[str] = frozenset()
        self._described = not use_wire  # nothing to discover when the wire is not wanted
        self._backoff_s = 0.0
        self._wire_retry_at = 0.0  # loop time before which calls skip the wire (see WIRE_BACKOFF_S)
        self._describing: asyncio.Lock | None = None
        self._probe: asyncio.Task | None = None  # running while the breaker is open (see SILENT_BACKOFF_S)
        self._retired: set[asyncio.Task] = set()  # channels of masters left behind, closed after a grace

    @property
    def address(self) -> str:
        """The master calls go to now (with HA: the leader, as far as this link knows)."""
        return self.masters.current

    @property
    def wire(self) -> MasterWireClient | None:
        """The wire client in use, None while calls go over gRPC (not yet described, or no wire)."""
        return self._wire

    @property
    def stub(self) -> master_pb2_grpc.MasterStub:
        if self._stub is None:
            self._channel = cluster_auth.aio_channel(self.address, CHANNEL_OPTIONS)
            self._stub = master_pb2_grpc.MasterStub(self._channel)
        return self._stub

    async def call(self, name: str, request: Message, timeout_s: float | None = None) -> Any:
        """The master's reply to rpc ``name``; typed ``StoreError`` on failure (``MasterSilentError`` at
        once while the breaker is open)."""
        if self._probe is not None:
            self._count("failed_fast")
            raise MasterSilentError(
                f"master {self.address} let a call run to its deadline and has not answered a probe since; "
                f"{name} fails fast until it does"
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.rpc_timeout_s if timeout_s is None else timeout_s)
        try:
            try:
                return await self._call(name, request, timeout_s)
            except NotLeaderError as exc:  # nothing ran: once more at the leader, within the same deadline
                if not self._move(exc.leader) or deadline - loop.time() < MIN_RETRY_S:
                    raise
                return await self._call(name, request, deadline - loop.time())
        except TransportTimeoutError:
            self._count("silent")
            self._move(None)
            if self._probe is None:
                self._probe = loop.create_task(self._probe_until_answered())
            raise
        except StoreUnavailableError as exc:
            if not isinstance(exc, NotLeaderError):
                self._move(None)  # unreachable: the next call tries the next master of the group
            raise

    def _move(self, leader: str | None) -> bool:
        """Point the link at ``leader`` (or the next master); False with a single master."""
        if not self.masters.follow(leader):
            return False
        self._count("master_moves")
        channel, self._channel, self._stub = self._channel, None, None
        wire, self._wire = self._wire, None
        self._described = not self.use_wire
        if channel is not None or wire is not None:
            task = asyncio.get_running_loop().create_task(self._retire(channel, wire))
            self._retired.add(task)
            task.add_done_callback(self._retired.discard)
        return True

    async def _retire(self, channel: grpc.aio.Channel | None, wire: MasterWireClient | None) -> None:
        """Close a left-behind master's channels once calls still in flight on them had their deadline:
        closing a gRPC channel cancels its calls, and a cancellation must never reach a caller as if its
        own task had been cancelled."""
        try:
            await asyncio.sleep(self.rpc_timeout_s)
        finally:
            if wire is not None:
                await wire.close()
            if channel is not None:
                await channel.close()

    @property
    def silent(self) -> bool:
        """Whether the breaker is open (calls fail fast)."""
        return self._probe is not None

    async def _probe_until_answered(self) -> None:
        """Ask ``Describe`` (over gRPC, bounded) after each backoff step until the master answers anything."""
        backoff = SILENT_BACKOFF_S[0]
        try:
            while True:
                await asyncio.sleep(backoff)
                self._count("probes")
                try:
                    reply = await self.stub.Describe(
                        master_pb2.DescribeRequest(), timeout=min(self.rpc_timeout_s, 1.0)
                    )
                    if reply.leader or not self.masters.several:
                        return
                    self._move(reply.leader_address or None)  # a standby: ask the leader it names next
                    continue
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                        return  # an answer, even an error, means the master is there
                    self._move(None)
                backoff = min(backoff * 2, SILENT_BACKOFF_S[1])
        finally:
            self._probe = None

    async def _call(self, name: str, request: Message, timeout_s: float | None) -> Any:
        timeout = self.rpc_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        wire = await self._wire_for(name, timeout)
        if wire is None:
            return await self._grpc(name, request, deadline)
        try:
            reply = await wire.call(name, request, max(deadline - loop.time(), 0.0))
        except WireConnectError:
            self._forget_wire()
            if loop.time() >= self._wire_retry_at:  # one step per failed attempt, not per waiting call
                self._backoff_s = min(max(self._backoff_s * 2, WIRE_BACKOFF_S[0]), WIRE_BACKOFF_S[1])
                self._wire_retry_at = loop.time() + self._backoff_s
            self._count("wire_unreachable")
            return await self._grpc(name, request, deadline)
        except (TransportTimeoutError, NotLeaderError):  # no retry here: the time is spent / the caller moves
            raise
        except StoreUnavailableError:
            self._forget_wire()
            if name not in RETRY_OVER_GRPC or deadline - loop.time() < MIN_RETRY_S:
                raise
            self._count("wire_retried_over_grpc")
            return await self._grpc(name, request, deadline)
        except StoreError:  # the master's answer, an error (same class gRPC would give)
            self._count("wire_calls")
            raise
        self._count("wire_calls")
        self._backoff_s = 0.0
        return reply

    # -- typed calls: one method per master rpc, so readers and tools can jump to them -----------------------
    async def put_start(
        self, request: master_pb2.PutStartRequest, timeout_s: float | None = None
    ) -> master_pb2.PutStartReply:
        return await self.call("PutStart", request, timeout_s)

    async def put_commit(
        self, request: master_pb2.PutCommitRequest, timeout_s: float | None = None
    ) -> master_pb2.PutCommitReply:
        return await self.call("PutCommit", request, timeout_s)

    async def put_start_batch(
        self, request: master_pb2.PutStartBatchRequest, timeout_s: float | None = None
    ) -> master_pb2.PutStartBatchReply:
        return await self.call("PutStartBatch", request, timeout_s)

    async def put_commit_batch(
        self, request: master_pb2.PutCommitBatchRequest, timeout_s: float | None = None
    ) -> master_pb2.PutCommitBatchReply:
        return await self.call("PutCommitBatch", request, timeout_s)

    async def put_abort(
        self, request: master_pb2.PutAbortRequest, timeout_s: float | None = None
    ) -> master_pb2.PutAbortReply:
        return await self.call("PutAbort", request, timeout_s)

    async def match_prefix(
        self, request: master_pb2.MatchPrefixRequest, timeout_s: float | None = None
    ) -> master_pb2.MatchPrefixReply:
        return await self.call("MatchPrefix", request, timeout_s)

    async def lookup(
        self, request: master_pb2.LookupRequest, timeout_s: float | None = None
    ) -> master_pb2.LookupReply:
        return await self.call("Lookup", request, timeout_s)

    async def release(
        self, request: master_pb2.ReleaseRequest, timeout_s: float | None = None
    ) -> master_pb2.ReleaseReply:
        return await self.call("Release", request, timeout_s)

    async def remove(
        self, request: master_pb2.RemoveRequest, timeout_s: float | None = None
    ) -> master_pb2.RemoveReply:
        return await self.call("Remove", request, timeout_s)

    async def pin(
        self, request: master_pb2.PinRequest, timeout_s: float | None = None
    ) -> master_pb2.PinReply:
        return await self.call("Pin", request, timeout_s)

    async def set_quota(
        self, request: master_pb2.SetQuotaRequest, timeout_s: float | None = None
    ) -> master_pb2.SetQuotaReply:
        return await self.call("SetQuota", request, timeout_s)

    async def stats(
        self, request: master_pb2.StatsRequest, timeout_s: float | None = None
    ) -> master_pb2.StatsReply:
        return await self.call("Stats", request, timeout_s)

    async def describe(self, timeout_s: float | None = None) -> master_pb2.DescribeReply:
        """Ask the master what it serves (``Describe`` over gRPC, typed errors) and route calls by it."""
        async with self._lock():
            return await self._discover(self.rpc_timeout_s if timeout_s is None else timeout_s)

    async def close(self) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.cancel()
            await asyncio.gather(probe, return_exceptions=True)
        wire, self._wire = self._wire, None
        if wire is not None:
            await wire.close()
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None
        for task in list(self._retired):
            task.cancel()
        if self._retired:
            await asyncio.gather(*self._retired, return_exceptions=True)

    def _lock(self) -> asyncio.Lock:
        if self._describing is None:
            self._describing = asyncio.Lock()
        return self._describing

    async def _wire_for(self, name: str, timeout_s: float) -> MasterWireClient | None:
        if name not in WIRE_METHODS:
            return None
        if not self._described:
            if asyncio.get_running_loop().time() < self._wire_retry_at:
                return None
            async with self._lock():
                if not self._described:
                    await self._discover(timeout_s)
        return self._wire if name in self._wire_methods else None

    async def _discover(self, timeout_s: float) -> master_pb2.DescribeReply:
        self._count("describes")
        try:
            reply = await self.stub.Describe(master_pb2.DescribeRequest(), timeout=max(timeout_s, 0.001))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise_typed(exc, "master Describe")
            reply = master_pb2.DescribeReply()  # an older master: gRPC only
        old, self._wire = self._wire, None
        if reply.wire_port and self.use_wire:
            if old is not None and old.port == reply.wire_port:
                self._wire, old = old, None  # same listener: keep the connection other calls may be using
            else:
                self._wire = MasterWireClient(host_of(self.address), reply.wire_port, self.connect_timeout_s)
            self._wire_methods = frozenset(reply.wire_methods)
        else:
            self._wire_methods = frozenset()
        if old is not None:  # the master moved its wire (a restart) or turned it off
            await old.close()
        self._described = True
        return reply

    def _forget_wire(self) -> None:
        """Ask Describe again before the next wire-able call (the master may have restarted elsewhere)."""
        if self.use_wire:
            self._described = False

    async def _grpc(self, name: str, request: Message, deadline: float) -> Any:
        remaining = max(deadline - asyncio.get_running_loop().time(), 0.001)
        self._count("grpc_calls")
        try:
            return await getattr(self.stub, name)(request, timeout=remaining)
        except grpc.aio.AioRpcError as exc:
            raise_typed(exc, f"master {name}")

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    async def __aenter__(self) -> MasterLink:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
