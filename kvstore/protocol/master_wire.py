"""Master wire: every master call as length-prefixed protobuf frames over plain TCP (the one protocol).

Why this and not gRPC: measured with one master and three client processes, the framed calls answer
several times more ``MatchPrefix`` and write cycles per master CPU-second than the same calls over
Python gRPC (docs/measurements/). The messages are exactly the ``proto/master.proto`` ones (the proto stays
the only contract, framing and method table documented there); only the framing is ours. Each frame is a
fixed 20-byte little-endian header, then ``body_len`` bytes::

    magic "KVM1" | method u8 | status u8 | reserved u16 (0) | request_id u64 | body_len u32

* request: ``status`` 0, body = the serialized request message of ``method`` (ids in :data:`METHODS`);
* reply: the same method and request_id; ``status`` 0 and body = the serialized reply, or ``status`` = the
  failure's code from the one error table (``kvpool.kvstore.errors``: ``StoreError.code``) and body = the
  UTF-8 message, so the caller raises the very class the master raised.

Many requests may be in flight per connection; replies are matched by request_id. A bad magic, an unknown
method, a non-zero reserved field, a body over the cap (:data:`MAX_BODY`; :data:`MAX_BULK_BODY` for a
RegisterNode, which carries the node's whole inventory) or a frame not completed within ``frame_timeout_s``
closes that connection (the server keeps serving others); a body that does not parse is answered
``BadRequestError``. With a cluster secret the connection's first bytes are the hello
(``runtime.cluster_auth``); a connection without it (or with a wrong one) gets one *refusal frame* before the
server closes it: method 0, request_id 0 (no request uses either), ``status`` = ``UnauthenticatedError``'s
code, body = why. Every call waiting on that connection raises ``UnauthenticatedError``, naming where this
process reads its secret, instead of a bare "connection lost".

This module is the contract plus its two clients: :class:`MasterWireClient` (asyncio, multiplexed, what
:class:`~kvpool.kvstore.protocol.master_link.MasterLink` uses) and :func:`call_blocking` (one call on its own
connection, for probes and tools). The server is ``kvpool.kvstore.master.wire_server``.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from google.protobuf.message import DecodeError, Message
from kvpool.kvstore.errors import (
    BadRequestError,
    StoreError,
    StoreUnavailableError,
    TransportTimeoutError,
    UnauthenticatedError,
    error_for_code,
)
from kvpool.proto import common_pb2, master_pb2
from kvpool.runtime import cluster_auth

MAGIC = b"KVM1"
HEADER = struct.Struct("<4sBBHQI")
HEADER_SIZE = HEADER.size  # 20
MAX_BODY = 64 << 20
MAX_BULK_BODY = 1 << 30  # a RegisterNode inventory of ~10M objects fits in one frame
FRAME_TIMEOUT_S = 5.0  # a started frame must be complete within this
MAX_ERROR_BYTES = 4096
STATUS_OK = 0
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WireMethod:
    """One master call: its wire id, the MasterCore method that implements it and its message types."""

    method_id: int
    name: str  # the call's name in master.proto's method table
    core_method: str | None  # MasterCore attribute; None: answered by the server itself (Describe)
    request: type[Message]
    reply: type[Message]
    bulk: bool = False  # request capped at MAX_BULK_BODY instead of MAX_BODY


METHODS: dict[str, WireMethod] = {
    m.name: m
    for m in (
        WireMethod(1, "PutStart", "put_start", master_pb2.PutStartRequest, master_pb2.PutStartReply),
        WireMethod(2, "PutCommit", "put_commit", master_pb2.PutCommitRequest, master_pb2.PutCommitReply),
        WireMethod(3, "PutAbort", "put_abort", master_pb2.PutAbortRequest, master_pb2.PutAbortReply),
        WireMethod(4, "Lookup", "lookup", master_pb2.LookupRequest, master_pb2.LookupReply),
        WireMethod(5, "Release", "release", master_pb2.ReleaseRequest, master_pb2.ReleaseReply),
        WireMethod(
            6, "MatchPrefix", "match_prefix", master_pb2.MatchPrefixRequest, master_pb2.MatchPrefixReply
        ),
        WireMethod(7, "Remove", "remove", master_pb2.RemoveRequest, master_pb2.RemoveReply),
        WireMethod(8, "Pin", "pin", master_pb2.PinRequest, master_pb2.PinReply),
        WireMethod(9, "Stats", "stats", master_pb2.StatsRequest, master_pb2.StatsReply),
        WireMethod(10, "SetQuota", "set_quota", master_pb2.SetQuotaRequest, master_pb2.SetQuotaReply),
        WireMethod(
            11,
            "PutStartBatch",
            "put_start_batch",
            master_pb2.PutStartBatchRequest,
            master_pb2.PutStartBatchReply,
        ),
        WireMethod(
            12,
            "PutCommitBatch",
            "put_commit_batch",
            master_pb2.PutCommitBatchRequest,
            master_pb2.PutCommitBatchReply,
        ),
        WireMethod(
            13,
            "RegisterNode",
            "register_node",
            master_pb2.RegisterNodeRequest,
            master_pb2.RegisterNodeReply,
            bulk=True,
        ),
        WireMethod(14, "Heartbeat", "heartbeat", master_pb2.HeartbeatRequest, master_pb2.HeartbeatReply),
        WireMethod(15, "Describe", None, master_pb2.DescribeRequest, master_pb2.DescribeReply),
    )
}
BY_ID: dict[int, WireMethod] = {m.method_id: m for m in METHODS.values()}


REFUSAL_METHOD_ID = 0  # a connection-level refusal frame (never a request): see the module docstring


def refusal_frame(status: int, reason: str) -> bytes:
    """The frame a server sends before closing a connection it refuses (bad or missing hello)."""
    return encode(REFUSAL_METHOD_ID, status, 0, reason.encode("utf-8", "replace")[:MAX_ERROR_BYTES])


def refusal_error(status: int, payload: bytes, address: str, key: Any = None) -> StoreUnavailableError:
    """The typed error a refusal frame stands for, with this process's side of the story appended
    (``cluster_auth.refusal_advice``: for a secret problem, which secret it presented and where a secret is
    read from). ``key``: the secret the connection presented, when not this process's."""
    reason = payload.decode("utf-8", "replace")
    advice = cluster_auth.refusal_advice(reason) if key is None else cluster_auth.refusal_advice(reason, key)
    error = error_for_code(status, f"master {address}: {reason}; {advice}")
    if not isinstance(error, StoreUnavailableError):  # a refusal only ever means: not served here
        return StoreUnavailableError(str(error))
    return error


class WireFrameError(ValueError):
    """The bytes are not a valid master wire frame: the connection they came on is closed."""


def encode(method_id: int, status: int, request_id: int, body: bytes) -> bytes:
    """Header + body as one bytes object (one write, one segment for small calls)."""
    return HEADER.pack(MAGIC, method_id, status, 0, request_id, len(body)) + body


def decode_header(
    buf: bytes | bytearray, offset: int = 0, max_body: int = MAX_BODY, max_bulk_body: int = MAX_BULK_BODY
) -> tuple[int, int, int, int]:
    """``(method_id, status, request_id, body_len)`` of the header at ``buf[offset:]``."""
    magic, method_id, status, reserved, request_id, body_len = HEADER.unpack_from(buf, offset)
    if magic != MAGIC or reserved != 0:
        raise WireFrameError(f"bad header {bytes(buf[offset : offset + HEADER_SIZE]).hex()}")
    if method_id == REFUSAL_METHOD_ID and request_id == 0 and status != STATUS_OK:
        if body_len > MAX_ERROR_BYTES:
            raise WireFrameError(f"refusal frame body_len {body_len} exceeds {MAX_ERROR_BYTES}")
        return method_id, status, request_id, body_len
    method = BY_ID.get(method_id)
    if method is None:
        raise WireFrameError(f"unknown method id {method_id}")
    cap = max_bulk_body if method.bulk else max_body
    if body_len > cap:
        raise WireFrameError(f"{method.name} body_len {body_len} exceeds {cap}")
    return method_id, status, request_id, body_len


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` or ``[v6]:port``; BadRequestError when there is no port."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not port.isdigit():
        raise BadRequestError(f"master address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class FrameBuffer:
    """Cuts received bytes into complete frames; raises WireFrameError on garbage.

    Bytes that arrive as whole frames are parsed in place; only a started frame is kept, in a bytearray
    that grows at the end and is trimmed at the front (both amortised O(1)), so a 64 MiB body arriving in
    64 KiB reads is copied once, not once per read."""

    def __init__(self, max_body: int = MAX_BODY, max_bulk_body: int = MAX_BULK_BODY) -> None:
        self.max_body = max_body
        self.max_bulk_body = max_bulk_body
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, int, bytes]]:
        buf = self.buf
        src: bytes | bytearray = data
        if buf:
            buf += data
            src = buf
        frames = []
        pos = 0
        size = len(src)
        while size - pos >= HEADER_SIZE:
            method_id, status, request_id, body_len = decode_header(
                src, pos, self.max_body, self.max_bulk_body
            )
            end = pos + HEADER_SIZE + body_len
            if size < end:
                break
            frames.append((method_id, status, request_id, bytes(src[pos + HEADER_SIZE : end])))
            pos = end
        if src is buf:
            if pos:
                del buf[:pos]
        elif pos < size:
            buf += memoryview(src)[pos:]
        return frames

    @property
    def partial(self) -> bool:
        """A frame has started and is not complete."""
        return bool(self.buf)


def no_delay(transport: asyncio.Transport) -> None:
    """TCP_NODELAY on an asyncio transport's socket: small frames must not wait for Nagle."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def request_body(method: WireMethod, request: Message) -> bytes:
    """The serialized request; BadRequestError when it is over the method's cap (nothing is sent)."""
    body = request.SerializeToString()
    cap = MAX_BULK_BODY if method.bulk else MAX_BODY
    if len(body) > cap:
        raise BadRequestError(f"master {method.name}: request of {len(body)} B exceeds {cap} B")
    return body


def put_start_batch_request(
    metas: Sequence[common_pb2.ObjectMeta],
    *,
    token_ids: Sequence[Sequence[int]] = (),
    routes: Sequence[bytes] = (),
    retain: Sequence[bool] = (),
    replace_if_corrupt: Sequence[bool] = (),
    checksum_at_commit: bool = False,
    shard_set: str = "",
) -> master_pb2.PutStartBatchRequest:
    """The column-wise PutStartBatch (master.proto) that starts a put of each of ``metas`` (its key, kind,
    size, checksum, tenant, parent, TTL and tier); ``token_ids``, ``routes``, ``retain`` and
    ``replace_if_corrupt`` hold one entry per meta, or none. Each column is sent as short as the master
    reads it: empty where every object has the default, one value where all agree."""
    counts = [len(t) for t in token_ids]
    return master_pb2.PutStartBatchRequest(
        shard_set=shard_set,
        keys=[m.key for m in metas],
        kinds=_compact([m.kind for m in metas], 0),
        sizes=_compact([m.size for m in metas], 0),
        parents=_compact([m.parent for m in metas], b""),
        tenants=_compact([m.tenant for m in metas], ""),
        ttl_ms=_compact([m.ttl_ms for m in metas], 0),
        tiers=_compact([m.tier for m in metas], 0),
        checksums=_compact([m.checksum for m in metas], 0),
        checksum_at_commit=checksum_at_commit,
        replace_if_corrupt=_compact(list(replace_if_corrupt), False),
        routes=_compact(list(routes), b""),
        token_ids=[t for ids in token_ids for t in ids],
        token_counts=_compact(counts, 0),
        retain=_compact(list(retain), False),
    )


def _compact(column: list[T], default: T) -> Sequence[T]:
    """A request column as short as the master reads it: empty when every object has ``default``, one
    value when they all have the same one, else the column itself."""
    first = column[0] if column else default
    if any(v != first for v in column):
        return column
    return () if first == default else (first,)


def parse_reply(method: WireMethod, status: int, payload: bytes) -> Any:
    """The reply message, or raise the typed error the master answered with."""
    if status != STATUS_OK:
        raise error_for_code(status, f"master {method.name}: {payload.decode('utf-8', 'replace')}")
    try:
        return method.reply.FromString(payload)
    except DecodeError as exc:
        raise StoreUnavailableError(f"master {method.name}: undecodable wire reply: {exc}") from exc


class _ClientConnection(asyncio.Protocol):
    """One multiplexed connection: replies resolve the pending futures by request_id."""

    def __init__(self, address: str) -> None:
        self.address = address  # for error messages
        self.frames = FrameBuffer()
        self.refused: StoreUnavailableError | None = None  # the server's refusal, once it came
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self.closed = False
        self.write_blocked: asyncio.Future[None] | None = None  # set while the kernel buffer is full
        self._next_id = 0
        self._out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a cast, not an isinstance check: uvloop's transports have asyncio.Transport's methods without
        # subclassing it (the check refused every connection under uvloop.run)
        self.transport = cast(asyncio.Transport, transport)
        no_delay(transport)
        hello = cluster_auth.client_hello()  # with a cluster secret: before any frame
        if hello:
            transport.write(hello)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.frames.feed(data)
        except WireFrameError as exc:
            self.fail(StoreUnavailableError(f"master wire: bad reply frame: {exc}"))
            return
        pending = self.pending
        for method_id, status, request_id, body in frames:
            if method_id == REFUSAL_METHOD_ID:  # the server refused this connection (cluster secret)
                self.fail(refusal_error(status, body, self.address))
                return
            fut = pending.pop(request_id, None)
            if fut is not None and not fut.done():  # a reply to a call that timed out is dropped
                fut.set_result((status, body))

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(StoreUnavailableError(f"master wire: connection lost{f': {exc}' if exc else ''}"))

    def pause_writing(self) -> None:
        self.write_blocked = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        blocked, self.write_blocked = self.write_blocked, None
        if blocked is not None and not blocked.done():
            blocked.set_result(None)

    def fail(self, error: StoreUnavailableError) -> None:
        """Close the connection; every call waiting on it gets ``error`` (the server's refusal, once it came,
        stays the reason: the close that follows it is no news)."""
        if self.refused is not None:
            error = self.refused
        elif isinstance(error, UnauthenticatedError):
            self.refused = error
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error)
        blocked, self.write_blocked = self.write_blocked, None
        if blocked is not None and not blocked.done():  # its waiters see ``closed``: nothing was sent
            blocked.set_result(None)

    def send(self, method_id: int, body: bytes) -> tuple[int, asyncio.Future[tuple[int, bytes]]]:
        assert self.transport is not None
        self._next_id += 1
        request_id = self._next_id
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[int, bytes]] = loop.create_future()
        self.pending[request_id] = fut
        if not self._out:  # calls made in one loop pass (a gathered batch) leave in one write
            loop.call_soon(self._flush)
        self._out.append(encode(method_id, STATUS_OK, request_id, body))
        return request_id, fut

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and not self.closed and self.transport is not None:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))


def _consume_error(attempt: asyncio.Future[Any]) -> None:
    """Mark a failed connect attempt's error as seen (its callers may all have timed out already)."""
    if not attempt.cancelled():
        attempt.exception()


def _expire(fut: asyncio.Future[Any], error: TransportTimeoutError) -> None:
    if not fut.done():
        fut.set_exception(error)


class MasterWireClient:
    """One multiplexed connection to one master, opened on first use and again after it was lost:
    ``reply = await client.call("Lookup", request, timeout_s)``. Use from one event loop.

    Failures are typed: the master's own answer is the class it raised; a connection that cannot be opened
    or is lost with the call in flight is ``StoreUnavailableError`` (lost: the master may or may not have
    run it); every wait ends at the call's deadline with ``TransportTimeoutError``.
    """

    def __init__(self, address: str, connect_timeout_s: float = 2.0) -> None:
        self.address = address
        self.host, self.port = split_address(address)
        self.connect_timeout_s = connect_timeout_s
        self._conn: _ClientConnection | None = None
        self._connecting: asyncio.Future[_ClientConnection] | None = None
        self._generation = 0  # bumped by close(): a connect that finishes later is dropped

    async def call(self, name: str, request: Message, timeout_s: float) -> Any:
        method = METHODS[name]
        body = request_body(method, request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        conn = await self._connection(deadline, timeout_s)
        timer: asyncio.TimerHandle | None = None
        request_id = 0
        try:
            if conn.write_blocked is not None:  # the master is not reading: wait, bounded, for room
                await asyncio.wait_for(asyncio.shield(conn.write_blocked), max(deadline - loop.time(), 0.0))
            if conn.closed:  # lost (or refused) before this request went out
                raise conn.refused or StoreUnavailableError(f"master wire: connection to {self.address} lost")
            request_id, fut = conn.send(method.method_id, body)
            error = TransportTimeoutError(
                f"master {name}: no reply from {self.address} within {timeout_s:.3f}s"
            )
            timer = loop.call_at(deadline, _expire, fut, error)
            status, payload = await fut
        except TimeoutError as exc:
            if isinstance(exc, TransportTimeoutError):
                raise
            raise TransportTimeoutError(f"master {name}: wire send blocked for {timeout_s:.3f}s") from exc
        finally:
            if timer is not None:
                timer.cancel()
            if request_id:
                conn.pending.pop(request_id, None)
        return parse_reply(method, status, payload)

    async def _connection(self, deadline: float, timeout_s: float) -> _ClientConnection:
        """The open connection, or one attempt to open it shared by every call that arrives meanwhile (a
        gathered batch against an unreachable master fails once, after one connect timeout, not in turn)."""
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        attempt = self._connecting
        if attempt is None or attempt.done():
            attempt = self._connecting = asyncio.ensure_future(self._connect(self.connect_timeout_s))
            attempt.add_done_callback(_consume_error)
        try:
            async with asyncio.timeout_at(deadline):
                return await asyncio.shield(attempt)
        except TimeoutError as exc:
            if isinstance(exc, TransportTimeoutError):
                raise
            raise TransportTimeoutError(
                f"master wire: no connection to {self.address} within {timeout_s:.3f}s"
            ) from exc

    async def _connect(self, timeout_s: float) -> _ClientConnection:
        loop = asyncio.get_running_loop()
        generation = self._generation
        try:
            connect = loop.create_connection(lambda: _ClientConnection(self.address), self.host, self.port)
            _transport, conn = await asyncio.wait_for(connect, timeout_s)
        except TimeoutError as exc:
            raise StoreUnavailableError(
                f"master wire: connecting to {self.address} timed out ({timeout_s:.3f}s)"
            ) from exc
        except OSError as exc:
            raise StoreUnavailableError(f"master wire: cannot connect to {self.address}: {exc}") from exc
        if generation != self._generation:  # close() ran meanwhile: nobody may be left holding a socket
            conn.fail(StoreUnavailableError("master wire: client closed"))
            raise StoreUnavailableError(f"master wire: client closed while connecting to {self.address}")
        self._conn = conn
        return conn

    async def close(self) -> None:
        """Drop the connection; calls still in flight fail with StoreUnavailableError."""
        self._generation += 1
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.fail(StoreUnavailableError("master wire: client closed"))


def call_blocking(
    address: str, name: str, request: Message, timeout_s: float = 3.0, *, key: bytes | None = None
) -> Any:
    """One call on its own connection, blocking (health probes, ``kvpool status``, tools and tests): the
    reply, or the typed error; TransportTimeoutError past ``timeout_s``, StoreUnavailableError when the
    master cannot be reached. ``key``: the cluster secret to say hello with (default: this process's)."""
    method = METHODS[name]
    body = request_body(method, request)
    hello = cluster_auth.hello(key) if key else cluster_auth.client_hello()
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection(split_address(address), timeout=timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(hello + encode(method.method_id, STATUS_OK, 1, body))
            frames = FrameBuffer()
            while True:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                data = sock.recv(1 << 16)
                if not data:
                    raise StoreUnavailableError(f"master {name}: {address} closed the connection")
                got = frames.feed(data)
                if got:
                    method_id, status, _request_id, payload = got[0]
                    if method_id == REFUSAL_METHOD_ID:
                        raise refusal_error(status, payload, address, key)
                    return parse_reply(method, status, payload)
    except StoreError:  # the master's answer, or raised above (both OSError subclasses, kept as they are)
        raise
    except TimeoutError as exc:
        raise TransportTimeoutError(
            f"master {name}: no reply from {address} within {timeout_s:.3f}s"
        ) from exc
    except WireFrameError as exc:
        raise StoreUnavailableError(f"master {name}: bad reply frame from {address}: {exc}") from exc
    except OSError as exc:
        raise StoreUnavailableError(f"master {name}: cannot reach {address}: {exc}") from exc
