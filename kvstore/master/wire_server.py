"""Master wire, server side: the listener on the master's event loop (protocol in ``master_wire``).

Every call goes through the same :class:`~kvpool.kvstore.master.dispatch.CoreDispatch` as the gRPC
servicer, so errors, counters and node orders are identical on both channels.
"""

from __future__ import annotations

import asyncio
import logging

from google.protobuf.message import DecodeError, Message
from kvpool.kvstore.master.dispatch import CoreCallError, CoreDispatch
from kvpool.kvstore.protocol.master_wire import (
    BY_ID,
    FRAME_TIMEOUT_S,
    MAX_BODY,
    MAX_ERROR_BYTES,
    STATUS_OK,
    FrameBuffer,
    WireFrameError,
    WireMethod,
    encode,
    no_delay,
    status_number,
)
from kvpool.runtime import cluster_auth
from kvpool.runtime.cluster_auth import HELLO_SIZE

log = logging.getLogger(__name__)


class _ServerConnection(asyncio.Protocol):
    """One client connection: cut frames, run each call through the dispatch, write the replies (all
    replies to one read go out in one write)."""

    def __init__(self, server: MasterWireServer) -> None:
        self.server = server
        self.frames = FrameBuffer(server.max_body)
        self.transport: asyncio.Transport | None = None
        # with a cluster secret: the connection's first bytes must be the hello; nothing runs before it
        self._hello: bytearray | None = bytearray() if server.auth is not None else None
        self._frame_timer: asyncio.TimerHandle | None = None
        self._waiting: set[asyncio.Task[None]] = set()
        self._out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        no_delay(transport)
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
        if self._hello is not None:
            need = HELLO_SIZE - len(self._hello)
            self._hello += data[:need]
            data = data[need:]
            if len(self._hello) < HELLO_SIZE:
                return
            assert self.server.auth is not None
            if not self.server.auth.verify(bytes(self._hello), self._peer()):
                self.server.count("wire_auth_rejected")
                self.abort()
                return
            self._hello = None
            if not data:
                return
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
            reply, done = self.server.dispatch.run(method.core_method, request)
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
        dispatch: CoreDispatch,
        *,
        frame_timeout_s: float = FRAME_TIMEOUT_S,
        max_body: int = MAX_BODY,
    ) -> None:
        self.dispatch = dispatch
        self.auth = cluster_auth.server_hello_check("master wire")
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
        self.dispatch.core.count(name)

    async def close(self) -> None:
        """Stop listening and drop every connection (their in-flight calls fail on the client side)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for conn in list(self.connections):
            conn.abort()
        if server is not None:
            await server.wait_closed()
