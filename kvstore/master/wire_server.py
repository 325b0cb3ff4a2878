"""The master's listener: every master call over the master wire (protocol in ``protocol/master_wire``).

Each call runs the synchronous :class:`~kvpool.kvstore.master.core.MasterCore` method on the event loop (one
thread: no locks). A typed store error the core raises is answered with its code from the one error table
(``kvpool.kvstore.errors``), so the caller raises the same class; any other exception is answered as a plain
``StoreError`` without taking the server down (a bug costs one call). The node orders a call produced go to
the :class:`~kvpool.kvstore.master.node_notifier.NodeNotifier` right away and the reply does not wait for
them: nodes are ordered in the background, and a lost order is reconciled by the node's next registration.

Calls are resolved by name on the current core, because with HA the core is replaced on every election (a
new leader starts from an empty index that the nodes' inventories refill). A ``gate`` (``ha.HaMaster``) may
refuse a call before it runs: a standby answers ``NotLeaderError`` naming the leader, and nothing was
executed. ``Describe`` is answered by the server itself and never gated: it is how probes and clients learn
who leads.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any, Protocol, cast

from google.protobuf.message import DecodeError, Message
from kvpool.kvstore.errors import (
    BadRequestError,
    CapacityExceededError,
    NotLeaderError,
    StoreError,
    UnauthenticatedError,
)
from kvpool.kvstore.master.core import MasterCore
from kvpool.kvstore.master.node_notifier import NodeNotifier
from kvpool.kvstore.protocol.master_wire import (
    BY_ID,
    FRAME_TIMEOUT_S,
    MAX_BODY,
    MAX_BULK_BODY,
    MAX_ERROR_BYTES,
    STATUS_OK,
    FrameBuffer,
    WireFrameError,
    WireMethod,
    encode,
    no_delay,
    refusal_frame,
)
from kvpool.proto import master_pb2
from kvpool.runtime import cluster_auth
from kvpool.runtime.cluster_auth import HELLO_SIZE

log = logging.getLogger(__name__)
_PLACES_PUTS = frozenset({"put_start", "put_start_batch"})  # the calls whose reply may wait for a delete


class Gate(Protocol):
    """Decides whether this master may run a call now (HA: only the leader may)."""

    def refusal(self, method: str) -> str | None:
        """None to run core method ``method``; else why not, naming the leader (``leader=HOST:PORT``)."""
        ...


def error_counter(exc: StoreError) -> str:
    """The core counter a failed call bumps: ``rpc_`` + the class name in snake case, without ``Error``
    (BadRequestError -> ``rpc_bad_request``)."""
    name = type(exc).__name__.removesuffix("Error") or "store"
    return "rpc_" + re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class _ServerConnection(asyncio.Protocol):
    """One client connection: cut frames, run each call, write the replies (all replies to one read go out
    in one write)."""

    def __init__(self, server: MasterWireServer) -> None:
        self.server = server
        self.frames = FrameBuffer(server.max_body, server.max_bulk_body)
        self.transport: asyncio.Transport | None = None
        # with a cluster secret: the connection's first bytes must be the hello; nothing runs before it
        self._hello: bytearray | None = bytearray() if server.auth is not None else None
        self._frame_timer: asyncio.TimerHandle | None = None
        self._refused = False  # the hello failed: the refusal was sent, nothing more is read
        self._out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a cast, not an isinstance check: uvloop's transports have asyncio.Transport's methods without
        # subclassing it (the check refused every connection under uvloop.run)
        self.transport = cast(asyncio.Transport, transport)
        no_delay(transport)
        self.server.connections.add(self)
        if self._hello is not None:  # the hello is bounded like a frame: a peer that stalls in it is closed
            loop = asyncio.get_running_loop()
            self._frame_timer = loop.call_later(self.server.frame_timeout_s, self._frame_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._cancel_timer()

    # flow control: a client that does not read its replies stops being read from
    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._refused:  # drained and dropped until the peer closes
            return
        if self._hello is not None:
            need = HELLO_SIZE - len(self._hello)
            self._hello += data[:need]
            data = data[need:]
            auth = self.server.auth
            assert auth is not None
            if len(self._hello) < HELLO_SIZE and not auth.cannot_be_hello(bytes(self._hello)):
                return
            why = auth.refusal(bytes(self._hello), self._peer())
            if why is not None:
                self.server.count("wire_auth_rejected")
                self._refuse(why)
                return
            self._hello = None
            self._cancel_timer()
            if not data:
                return
        try:
            frames = self.frames.feed(data)
            for method_id, status, request_id, body in frames:
                if status != STATUS_OK:
                    raise WireFrameError(f"request {request_id} with status {status}")
                self._answer(BY_ID[method_id], request_id, body)
        except WireFrameError as exc:
            self.server.count("wire_bad_frames")
            log.warning("master wire: closing %s: %s", self._peer(), exc)
            self.abort()
            return
        finally:
            self._flush()
        if frames:
            self._cancel_timer()  # progress: the deadline is per frame, not per connection
        if self.frames.partial and self._frame_timer is None:
            loop = asyncio.get_running_loop()
            self._frame_timer = loop.call_later(self.server.frame_timeout_s, self._frame_expired)
        elif not self.frames.partial:
            self._cancel_timer()

    def _answer(self, method: WireMethod, request_id: int, body: bytes) -> None:
        try:
            reply, after = self.server.run(method, body)
        except StoreError as exc:
            message = str(exc).encode("utf-8", "replace")[:MAX_ERROR_BYTES]
            self._out.append(encode(method.method_id, exc.code, request_id, message))
            return
        frame = encode(method.method_id, STATUS_OK, request_id, reply)
        if not after:
            self._out.append(frame)
            return
        asyncio.get_running_loop().create_task(self._answer_after(after, frame))

    async def _answer_after(self, after: list[asyncio.Future[None]], frame: bytes) -> None:
        """Send ``frame`` once the node orders it depends on were sent (bounded by the notifier's deadline,
        which bounds each of those calls anyway); replies are matched by id, so others overtake it."""
        await asyncio.wait(after, timeout=self.server.notifier.timeout_s)
        self._out.append(frame)
        self._flush()

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def _refuse(self, why: str) -> None:
        """Answer the connection-level refusal frame (``master_wire.refusal_frame``: the client raises
        UnauthenticatedError with this reason) and close once it is written; nothing the peer sent ran."""
        self._cancel_timer()
        self._refused = True
        if self.transport is None:
            return
        reason = f"the master refused the connection: {why}"
        self.transport.write(refusal_frame(UnauthenticatedError.code, reason))
        # Half-close and drain: closing with the peer's pipelined frame unread would reset the connection,
        # and a reset can discard the refusal before the peer reads it. The peer closes on the refusal;
        # one that does not is cut off after the frame deadline.
        self.transport.write_eof()
        self._frame_timer = asyncio.get_running_loop().call_later(self.server.frame_timeout_s, self.abort)

    def _frame_expired(self) -> None:
        self._frame_timer = None
        self.server.count("wire_frame_timeouts")
        log.warning(
            "master wire: closing %s: frame not completed within %.1fs",
            self._peer(),
            self.server.frame_timeout_s,
        )
        self.abort()

    def _cancel_timer(self) -> None:
        if self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None

    def _peer(self) -> str:
        return str(self.transport.get_extra_info("peername")) if self.transport is not None else "?"

    def abort(self) -> None:
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()


class MasterWireServer:
    """The master's wire listener on its event loop: ``port = await server.start(host, 0)`` ...
    ``await server.close()``. ``core`` may be replaced at any time (HA); ``leadership`` says
    ``(epoch, leader?, leader address)`` for Describe (no HA: ``(0, True, "")``)."""

    def __init__(
        self,
        core: MasterCore,
        notifier: NodeNotifier,
        *,
        gate: Gate | None = None,
        leadership: Callable[[], tuple[int, bool, str]] = lambda: (0, True, ""),
        frame_timeout_s: float = FRAME_TIMEOUT_S,
        max_body: int = MAX_BODY,
        max_bulk_body: int = MAX_BULK_BODY,
    ) -> None:
        self.core = core
        self.notifier = notifier
        self.gate = gate
        self.leadership = leadership
        self.shard_map: Callable[[], str] = lambda: ""  # HA with shards: the fleet's shard leaders
        self.auth = cluster_auth.server_hello_check("master wire")
        self.frame_timeout_s = frame_timeout_s
        self.max_body = max_body
        self.max_bulk_body = max_bulk_body
        self.port = 0
        self.connections: set[_ServerConnection] = set()
        self._server: asyncio.Server | None = None

    def run(self, method: WireMethod, body: bytes) -> tuple[bytes, list[asyncio.Future[None]]]:
        """The serialized reply to one call and the node orders to be sent before it (a put placed where a
        delete of its key is still queued); raises the typed StoreError to answer with instead."""
        try:
            request = method.request.FromString(body)
        except DecodeError as exc:
            self.count("rpc_bad_request")
            raise BadRequestError(f"undecodable {method.name}: {exc}") from None
        if method.core_method is None:
            reply: Message = self.describe()
        else:
            reply = self._run_core(method.core_method, request)
        out = reply.SerializeToString()
        if len(out) > self.max_body:  # the clients' frame cap
            self.count("rpc_capacity_exceeded")
            raise CapacityExceededError(
                f"{method.name} reply of {len(out)} B exceeds the {self.max_body} B frame cap"
            )
        if method.core_method not in _PLACES_PUTS:
            return out, []
        return out, self._deletes_first(request, reply)

    def _deletes_first(self, request: Any, reply: Message) -> list[asyncio.Future[None]]:
        """For puts placed on a node that still has a delete of the same key queued: those deletes."""
        started = master_pb2.PutStartReply.STARTED
        if isinstance(reply, master_pb2.PutStartReply):
            if reply.status != started:
                return []
            placed = [(reply.node.node_id, request.meta.key)]
        elif isinstance(reply, master_pb2.PutStartBatchReply):
            if not self.notifier.deletes_queued():  # the common case: nothing to wait for, no loop
                return []
            node_ids = [ep.node_id for ep in reply.nodes]
            placed = [
                (node_ids[at], key)
                for key, status, at in zip(request.keys, reply.status, reply.node, strict=True)
                if status == started
            ]
        else:
            return []
        pending = (self.notifier.delete_pending(node_id, key) for node_id, key in placed)
        return [sent for sent in pending if sent is not None]

    def _run_core(self, name: str, request: Any) -> Message:
        if self.gate is not None:
            refusal = self.gate.refusal(name)
            if refusal is not None:
                self.count("rpc_not_leader")
                raise NotLeaderError(refusal)
        fn: Callable[[Any], Message] = getattr(self.core, name)
        try:
            return fn(request)
        except StoreError as exc:
            self.count(error_counter(exc))
            raise
        except Exception as exc:  # a bug must cost one call, never the server
            log.exception("%s failed", name)
            self.count("rpc_internal")
            raise StoreError(f"internal error: {type(exc).__name__}: {exc}") from exc
        finally:
            self.flush()

    def describe(self) -> master_pb2.DescribeReply:
        epoch, leader, leader_address = self.leadership()
        return master_pb2.DescribeReply(
            instance=self.core.instance,
            epoch=epoch,
            leader=leader,
            leader_address=leader_address,
            shard_set=str(self.core.config.shards),
            shard=self.core.config.shard,
            shard_masters=self.shard_map(),
        )

    def flush(self) -> None:
        """Hand every queued node order to the notifier (sent in the background)."""
        actions = self.core.take_actions()
        if actions:
            self.notifier.submit(actions)

    def count(self, name: str) -> None:
        self.core.count(name)

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host:port`` (0 = any free port); returns the bound port. Raises OSError."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerConnection(self), host, port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        """Stop listening and drop every connection (their in-flight calls fail on the client side)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for conn in list(self.connections):
            conn.abort()
        if server is not None:
            await server.wait_closed()
