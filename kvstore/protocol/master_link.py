"""``MasterLink``: the one way store clients, storage nodes and the gateway call the master.

``await link.lookup(request)`` sends the call over the master wire (``master_wire``) to the master the link
believes leads, under a deadline (``rpc_timeout_s`` unless the call names its own); failures are the typed
store errors the master raised, or ``StoreUnavailableError`` / ``TransportTimeoutError`` for the network.
Nothing is retried silently: a call whose connection broke may or may not have run, and the caller's own
logic (a miss, a failed put, a node's next heartbeat) must see that.

Follow the leader (``address`` lists an HA group's masters, ``"a:1,b:2"``): a standby answers
``NotLeaderError`` having run nothing, so the link moves to the leader it named and sends the call once
more within the same deadline. A master that cannot be reached or lets a call run to its deadline is left
for the next one of the list on the following call. No etcd client is needed to follow a failover.

Silent master (partitioned, frozen): a refused connection fails fast by itself, but silence costs each call
its whole deadline, and a worker makes several per request. So a call that runs to its deadline opens a
breaker: calls raise ``MasterSilentError`` at once (counted as ``failed_fast``) while a background probe
(``Describe`` on a fresh connection, one per ``SILENT_BACKOFF_S`` step: 0.2 s doubling to 2 s) asks the
master; its first answer closes the breaker. No request's call is ever the probe. The connection that went
silent is dropped (after the grace its other calls' deadlines need): a partition leaves it in TCP's
retransmission backoff long after the link heals, while a new connection's handshake goes out at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from google.protobuf.message import Message
from kvpool.kvstore.errors import (
    BadRequestError,
    MasterSilentError,
    NotLeaderError,
    StoreError,
    StoreUnavailableError,
    TransportTimeoutError,
)
from kvpool.kvstore.protocol.master_wire import MasterWireClient
from kvpool.proto import master_pb2

MIN_RETRY_S = 0.05  # a call to the named leader with less time left than this is not worth starting
SILENT_BACKOFF_S = (0.2, 2.0)  # the breaker's probe: first after 0.2 s, then doubling up to 2 s
PROBE_TIMEOUT_S = 1.0


class MasterAddresses:
    """The masters of one cluster (one address, or an HA group's list) and the one believed to lead.

    With a single address nothing ever moves. With a list, a ``NotLeaderError`` moves to the leader the
    standby named, if it is in the list, else to the next address; so a failover costs each caller one failed
    call per dead or standby master."""

    __slots__ = ("_at", "addresses")

    def __init__(self, spec: str) -> None:
        self.addresses = [a.strip() for a in spec.split(",") if a.strip()]
        if not self.addresses:
            raise BadRequestError(f"no master address in {spec!r}")
        self._at = 0

    @property
    def current(self) -> str:
        return self.addresses[self._at]

    @property
    def several(self) -> bool:
        return len(self.addresses) > 1

    def follow(self, leader: str | None) -> bool:
        """Move to ``leader`` when it is one of ours, else to the next address. False with one address
        (there is nowhere to go)."""
        if not self.several:
            return False
        at = (
            self.addresses.index(leader) if leader in self.addresses else (self._at + 1) % len(self.addresses)
        )
        if at == self._at:
            at = (self._at + 1) % len(self.addresses)
        self._at = at
        return True


class MasterLink:
    """See the module docstring. Use from one event loop; ``await link.close()`` when done."""

    def __init__(self, address: str, rpc_timeout_s: float = 5.0, *, connect_timeout_s: float = 1.0) -> None:
        self.masters = MasterAddresses(address)
        self.rpc_timeout_s = rpc_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.counters: dict[str, int] = {}
        self._wire: MasterWireClient | None = None
        self._probe: asyncio.Task[None] | None = None  # running while the breaker is open
        self._retired: set[asyncio.Task[None]] = set()  # connections left behind, closed after a grace

    @property
    def address(self) -> str:
        """The master calls go to now (with HA: the leader, as far as this link knows)."""
        return self.masters.current

    async def call(self, name: str, request: Message, timeout_s: float | None = None) -> Any:
        """The master's reply to ``name`` (a method of master.proto's table); typed ``StoreError`` on
        failure (``MasterSilentError`` at once while the breaker is open)."""
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
                return await self._send(name, request, deadline)
            except NotLeaderError as exc:  # nothing ran: once more at the leader, within the same deadline
                if not self._move(exc.leader) or deadline - loop.time() < MIN_RETRY_S:
                    raise
                return await self._send(name, request, deadline)
        except TransportTimeoutError:
            self._count("silent")
            if not self._move(None):
                self._reconnect()
            if self._probe is None:
                self._probe = loop.create_task(self._probe_until_answered())
            raise
        except StoreUnavailableError as exc:
            if not isinstance(exc, NotLeaderError):
                self._move(None)  # unreachable: the next call tries the next master of the group
            raise

    async def _send(self, name: str, request: Message, deadline: float) -> Any:
        if self._wire is None:
            self._wire = MasterWireClient(self.address, self.connect_timeout_s)
        self._count("calls")
        remaining = max(deadline - asyncio.get_running_loop().time(), 0.0)
        return await self._wire.call(name, request, remaining)

    def _move(self, leader: str | None) -> bool:
        """Point the link at ``leader`` (or the next master); False with a single master."""
        if not self.masters.follow(leader):
            return False
        self._count("master_moves")
        self._reconnect()
        return True

    def _reconnect(self) -> None:
        """Calls from now on go over a new connection; the old one closes once the calls still in flight on
        it had their deadline."""
        wire, self._wire = self._wire, None
        if wire is not None:
            task = asyncio.get_running_loop().create_task(self._retire(wire))
            self._retired.add(task)
            task.add_done_callback(self._retired.discard)

    async def _retire(self, wire: MasterWireClient) -> None:
        try:
            await asyncio.sleep(self.rpc_timeout_s)
        finally:
            await wire.close()

    async def _probe_until_answered(self) -> None:
        """Ask ``Describe`` (bounded, on a fresh connection) after each backoff step until the master answers
        anything; with several masters, walk the list until the leader answers."""
        backoff = SILENT_BACKOFF_S[0]
        try:
            while True:
                await asyncio.sleep(backoff)
                self._count("probes")
                probe = MasterWireClient(self.address, self.connect_timeout_s)
                try:
                    reply = await probe.call(
                        "Describe", master_pb2.DescribeRequest(), min(self.rpc_timeout_s, PROBE_TIMEOUT_S)
                    )
                    if reply.leader or not self.masters.several:
                        return
                    self._move(reply.leader_address or None)  # a standby: ask the leader it names next
                    continue
                except (StoreUnavailableError, TransportTimeoutError):
                    self._move(None)
                except StoreError:
                    return  # an answer, even an error, means the master is there
                finally:
                    await probe.close()
                backoff = min(backoff * 2, SILENT_BACKOFF_S[1])
        finally:
            self._probe = None

    # -- typed calls: one method per master call, so readers and tools can jump to them ----------------------
    async def register_node(
        self, request: master_pb2.RegisterNodeRequest, timeout_s: float | None = None
    ) -> master_pb2.RegisterNodeReply:
        return await self.call("RegisterNode", request, timeout_s)

    async def heartbeat(
        self, request: master_pb2.HeartbeatRequest, timeout_s: float | None = None
    ) -> master_pb2.HeartbeatReply:
        return await self.call("Heartbeat", request, timeout_s)

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
        """Who this master is: its instance, and with HA whether it leads, its epoch and the leader's
        address."""
        return await self.call("Describe", master_pb2.DescribeRequest(), timeout_s)

    async def close(self) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.cancel()
            await asyncio.gather(probe, return_exceptions=True)
        wire, self._wire = self._wire, None
        if wire is not None:
            await wire.close()
        for task in list(self._retired):
            task.cancel()
        if self._retired:
            await asyncio.gather(*self._retired, return_exceptions=True)

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    async def __aenter__(self) -> MasterLink:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
