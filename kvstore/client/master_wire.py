"""Master wire, client side: one multiplexed connection to the master (protocol in ``master_wire``).

Used through :class:`~kvpool.kvstore.client.master_link.MasterLink`; imports nothing of the master's own code.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from kvpool.kvstore.errors import BadRequestError, StoreUnavailableError, TransportTimeoutError
from kvpool.kvstore.protocol.grpc_errors import typed_error_from
from kvpool.kvstore.protocol.master_wire import (
    MAX_BODY,
    METHODS,
    STATUS_BY_NUMBER,
    STATUS_OK,
    FrameBuffer,
    WireConnectError,
    WireFrameError,
    encode,
    no_delay,
)
from kvpool.runtime import cluster_auth


class _ClientConnection(asyncio.Protocol):
    """One multiplexed connection: replies resolve the pending futures by request_id."""

    def __init__(self, max_body: int) -> None:
        self.frames = FrameBuffer(max_body)
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self.closed = False
        self.write_blocked: asyncio.Future[None] | None = None  # set while the kernel buffer is full
        self._next_id = 0
        self._out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
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
            code = STATUS_BY_NUMBER.get(status, grpc.StatusCode.UNKNOWN)
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
