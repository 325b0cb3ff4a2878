"""Master wire: the master's hot calls as length-prefixed protobuf frames over one plain TCP connection.

Why: a Python gRPC unary call costs 0.45-0.8 ms on a 2-vCPU box (both ends Python) and every store get
pays one master round trip, every put two. The same call framed over an asyncio TCP connection costs
~0.1 ms. The messages are exactly the ``proto/master.proto`` ones (the proto stays the only contract);
only the framing is ours. Each frame is a fixed 20-byte little-endian header, then ``body_len`` bytes::

    magic "KVM1" | method u8 | status u8 | reserved u16 (0) | request_id u64 | body_len u32

* request: ``status`` 0, body = the serialized request message of ``method`` (ids in :data:`METHODS`);
* reply: the same method and request_id; ``status`` 0 and body = the serialized reply, or ``status`` =
  the gRPC status code number and body = the UTF-8 error message (what the gRPC call would have said, so
  ``client_rpc.typed_error_from`` maps both to the same typed error).

Many requests may be in flight per connection; replies are matched by request_id. The server answers in
arrival order except for calls that wait for node orders (``Remove``), which answer when those were
attempted. A bad magic, an unknown method, a non-zero reserved field, a body over :data:`MAX_BODY` or a
frame not completed within ``frame_timeout_s`` closes that connection (the server keeps serving others);
a body that does not parse is answered INVALID_ARGUMENT. Nodes keep using gRPC (RegisterNode carries
inventories of up to 1 GiB; heartbeats are not hot).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from kvpool.kvstore.client_rpc import typed_error_from
from kvpool.kvstore.errors import BadRequestError, StoreUnavailableError, TransportTimeoutError
from kvpool.kvstore.master import MasterCore
from kvpool.kvstore.master_dispatch import CoreCallError, CoreDispatch
from kvpool.kvstore.master_nodes import NodeNotifier
from kvpool.proto import master_pb2

log = logging.getLogger(__name__)

MAGIC = b"KVM1"
HEADER = struct.Struct("<4sBBHQI")
HEADER_SIZE = HEADER.size  # 20
MAX_BODY = 64 << 20
FRAME_TIMEOUT_S = 5.0  # a started frame must be complete within this
MAX_ERROR_BYTES = 4096
STATUS_OK = 0

_STATUS_NUMBER = {code.name: code.value[0] for code in grpc.StatusCode}
_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True, slots=True)
class WireMethod:
    """One rpc of the Master service the wire carries: its id, the MasterCore method and message types."""

    method_id: int
    name: str  # the rpc name in master.proto (what MasterLink.call is given)
    core_method: str  # MasterCore attribute that implements it
    request: type[Message]
    reply: type[Message]


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
    )
}
BY_ID: dict[int, WireMethod] = {m.method_id: m for m in METHODS.values()}


class WireFrameError(ValueError):
    """The bytes are not a valid master wire frame: the connection they came on is closed."""


class WireConnectError(StoreUnavailableError):
    """The wire connection could not be opened: the request was never sent, so retrying it over another
    channel cannot execute it twice."""


def encode(method_id: int, status: int, request_id: int, body: bytes) -> bytes:
    """Header + body as one bytes object (one write, one segment for small calls)."""
    if len(body) > MAX_BODY:
        raise WireFrameError(f"body of {len(body)} B exceeds {MAX_BODY} B")
    return HEADER.pack(MAGIC, method_id, status, 0, request_id, len(body)) + body


def decode_header(
    buf: bytes | bytearray, offset: int = 0, max_body: int = MAX_BODY
) -> tuple[int, int, int, int]:
    """``(method_id, status, request_id, body_len)`` of the header at ``buf[offset:]``."""
    magic, method_id, status, reserved, request_id, body_len = HEADER.unpack_from(buf, offset)
    if magic != MAGIC or reserved != 0:
        raise WireFrameError(f"bad header {bytes(buf[offset : offset + HEADER_SIZE]).hex()}")
    if method_id not in BY_ID:
        raise WireFrameError(f"unknown method id {method_id}")
    if body_len > max_body:
        raise WireFrameError(f"body_len {body_len} exceeds {max_body}")
    return method_id, status, request_id, body_len


def status_number(code_name: str) -> int:
    """gRPC status code number for a status name (``"NOT_FOUND"`` -> 5); unknown names -> UNKNOWN (2)."""
    return _STATUS_NUMBER.get(code_name, grpc.StatusCode.UNKNOWN.value[0])


class _FrameBuffer:
    """Cuts received bytes into complete frames; raises WireFrameError on garbage.

    Bytes that arrive as whole frames are parsed in place; only a started frame is kept, in a bytearray
    that grows at the end and is trimmed at the front (both amortised O(1)), so a 64 MiB body arriving in
    64 KiB reads is copied once, not once per read."""

    def __init__(self, max_body: int) -> None:
        self.max_body = max_body
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
            method_id, status, request_id, body_len = decode_header(src, pos, self.max_body)
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


# ------------------------------------------------------------------------------------------------- server


class _ServerConnection(asyncio.Protocol):
    """One client connection: cut frames, run each call through the dispatch, write the replies (all
    replies to one read go out in one write)."""

    def __init__(self, server: MasterWireServer) -> None:
        self.server = server
        self.frames = _FrameBuffer(server.max_body)
        self.transport: asyncio.Transport | None = None
        self._frame_timer: asyncio.TimerHandle | None = None
        self._waiting: set[asyncio.Task[None]] = set()
        self._out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        _no_delay(transport)
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._cancel_timer()
        for task in self._waiting:
            task.cancel()

    # flow control: a client that does not read its replies stops being read from
    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.frames.feed(data)
            for method_id, status, request_id, body in frames:
                if status != STATUS_OK:
                    raise WireFrameError(f"request {request_id} with status {status}")
                self._call(BY_ID[method_id], request_id, body)
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

    def _call(self, method: WireMethod, request_id: int, body: bytes) -> None:
        try:
            request = method.request.FromString(body)
        except DecodeError as exc:
            self.server.count("rpc_invalid_argument")
            self._reply_error(method, request_id, "INVALID_ARGUMENT", f"undecodable {method.name}: {exc}")
            return
        try:
            reply, done = self.server.dispatch.run(self.server.handlers[method.method_id], request)
        except CoreCallError as exc:
            self._reply_error(method, request_id, exc.code, exc.message)
            return
        if done:  # answered once its node orders were attempted; later calls are not held up
            loop = asyncio.get_running_loop()
            task = loop.create_task(self._reply_when_settled(method, request_id, reply, done))
            self._waiting.add(task)
            task.add_done_callback(self._waiting.discard)
        else:
            self._reply_ok(method, request_id, reply)

    async def _reply_when_settled(
        self, method: WireMethod, request_id: int, reply: Message, done: list[asyncio.Future[None]]
    ) -> None:
        await self.server.dispatch.settle(done)
        self._reply_ok(method, request_id, reply)
        self._flush()

    def _reply_ok(self, method: WireMethod, request_id: int, reply: Message) -> None:
        body = reply.SerializeToString()
        if len(body) > self.server.max_body:  # as gRPC refuses a reply over the clients' receive limit
            self.server.count("rpc_resource_exhausted")
            why = f"{method.name} reply of {len(body)} B exceeds the {self.server.max_body} B message limit"
            self._reply_error(method, request_id, "RESOURCE_EXHAUSTED", why)
            return
        self._out.append(encode(method.method_id, STATUS_OK, request_id, body))

    def _reply_error(self, method: WireMethod, request_id: int, code: str, message: str) -> None:
        body = message.encode("utf-8", "replace")[:MAX_ERROR_BYTES]
        self._out.append(encode(method.method_id, status_number(code), request_id, body))

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

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
    """The wire listener, on the master's event loop next to gRPC: ``port = await server.start(host, 0)``
    ... ``await server.close()``. Calls go through the same :class:`CoreDispatch` as gRPC's."""

    def __init__(
        self,
        core: MasterCore,
        notifier: NodeNotifier,
        *,
        frame_timeout_s: float = FRAME_TIMEOUT_S,
        max_body: int = MAX_BODY,
    ) -> None:
        self.core = core
        self.dispatch = CoreDispatch(core, notifier)
        self.handlers: dict[int, Callable[[Any], Any]] = {
            m.method_id: getattr(core, m.core_method) for m in METHODS.values()
        }
        self.frame_timeout_s = frame_timeout_s
        self.max_body = max_body
        self.port = 0
        self.connections: set[_ServerConnection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host:port`` (0 = any free port); returns the bound port. Raises OSError."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerConnection(self), host, port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    def count(self, name: str) -> None:
        self.core.count(name)

    async def close(self) -> None:
        """Stop listening and drop every connection (their in-flight calls fail on the client side)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for conn in list(self.connections):
            conn.abort()
        if server is not None:
            await server.wait_closed()


def _no_delay(transport: asyncio.Transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# ------------------------------------------------------------------------------------------------- client


class _ClientConnection(asyncio.Protocol):
    """One multiplexed connection: replies resolve the pending futures by request_id."""

    def __init__(self, max_body: int) -> None:
        self.frames = _FrameBuffer(max_body)
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self.closed = False
        self.write_blocked: asyncio.Future[None] | None = None  # set while the kernel buffer is full
        self._next_id = 0
        self._out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        _no_delay(transport)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.frames.feed(data)
        except WireFrameError as exc:
            self.fail(StoreUnavailableError(f"master wire: bad reply frame: {exc}"))
            return
        pending = self.pending
        for _method_id, status, request_id, body in frames:
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
        """Close the connection; every call waiting on it gets ``error``."""
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
    """Async client of :class:`MasterWireServer`: one multiplexed connection, opened on first use and
    again after it was lost. ``reply = await client.call("Lookup", request, timeout_s)``.

    Failures are the typed errors of the gRPC path (``client_rpc.typed_error_from``); a lost connection
    fails every call in flight on it with ``StoreUnavailableError`` (the master may or may not have run
    them); a connection that cannot be opened raises :class:`WireConnectError` (nothing was sent); every
    wait ends at the call's deadline with ``TransportTimeoutError``. Use from one event loop.
    """

    def __init__(
        self, host: str, port: int, connect_timeout_s: float = 2.0, *, max_body: int = MAX_BODY
    ) -> None:
        self.host = host
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        self.max_body = max_body
        self._conn: _ClientConnection | None = None
        self._connecting: asyncio.Future[_ClientConnection] | None = None
        self._generation = 0  # bumped by close(): a connect that finishes later is dropped

    @property
    def in_flight(self) -> int:
        """Calls sent and not answered yet."""
        return len(self._conn.pending) if self._conn is not None else 0

    async def call(self, name: str, request: Message, timeout_s: float) -> Any:
        method = METHODS.get(name)
        if method is None:
            raise BadRequestError(f"master wire: {name} is not a wire method")
        body = request.SerializeToString()
        if len(body) > self.max_body:
            raise BadRequestError(f"master {name}: request of {len(body)} B exceeds {self.max_body} B")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        conn = await self._connection(deadline, timeout_s)
        timer: asyncio.TimerHandle | None = None
        request_id = 0
        try:
            if conn.write_blocked is not None:  # the master is not reading: wait, bounded, for room
                await asyncio.wait_for(asyncio.shield(conn.write_blocked), max(deadline - loop.time(), 0.0))
            if conn.closed:  # lost before this request went out
                raise WireConnectError(f"master wire: connection to {self.host}:{self.port} lost")
            request_id, fut = conn.send(method.method_id, body)
            error = TransportTimeoutError(f"master {name}: no wire reply within {timeout_s:.3f}s")
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
        if status != STATUS_OK:
            code = _STATUS_BY_NUMBER.get(status, grpc.StatusCode.UNKNOWN)
            raise typed_error_from(code, payload.decode("utf-8", "replace"), f"master {name}")
        try:
            return method.reply.FromString(payload)
        except DecodeError as exc:
            raise StoreUnavailableError(f"master {name}: undecodable wire reply: {exc}") from exc

    async def _connection(self, deadline: float, timeout_s: float) -> _ClientConnection:
        """The open connection, or one attempt to open it shared by every call that arrives meanwhile (a
        gathered batch against an unreachable port fails once, after one connect timeout, not in turn)."""
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
            where = f"{self.host}:{self.port}"
            raise TransportTimeoutError(
                f"master wire: no connection to {where} within {timeout_s:.3f}s"
            ) from exc

    async def _connect(self, timeout_s: float) -> _ClientConnection:
        loop = asyncio.get_running_loop()
        where = f"{self.host}:{self.port}"
        generation = self._generation
        try:
            _transport, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _ClientConnection(self.max_body), self.host, self.port),
                timeout_s,
            )
        except TimeoutError as exc:
            raise WireConnectError(
                f"master wire: connecting to {where} timed out ({timeout_s:.3f}s)"
            ) from exc
        except OSError as exc:
            raise WireConnectError(f"master wire: cannot connect to {where}: {exc}") from exc
        if generation != self._generation:  # close() ran meanwhile: nobody may be left holding a socket
            conn.fail(StoreUnavailableError("master wire: client closed"))
            raise WireConnectError(f"master wire: client closed while connecting to {where}")
        self._conn = conn
        return conn

    async def close(self) -> None:
        """Drop the connection; calls still in flight fail with StoreUnavailableError."""
        self._generation += 1
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.fail(StoreUnavailableError("master wire: client closed"))
