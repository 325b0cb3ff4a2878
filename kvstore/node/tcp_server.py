"""The node's tcp data plane: raw non-blocking asyncio sockets, frames from ``protocol/data_frame``.

Payloads land straight in the shared-memory extent (``sock_recv_into`` on a view of the pool, hashed chunk by
chunk as they land) and leave straight from it: no intermediate copies, never ``readexactly``. A GET is
streamed: each ``SEND_CHUNK`` is hashed, then sent, and a trailer frame after the payload carries the node's
verdict (``FLAG_TRAILER``), so the first byte leaves at once instead of after a whole-object hash.
Requests on one connection are served in order, so clients pipeline a batch and read the responses back
in order.

Robustness: a bad header (magic, op, lengths) gets an error frame and the connection is closed; a frame that
stops arriving mid-way (truncated) is cut off after ``frame_timeout_s`` + size at the floor rate. A payload
the node refuses (no space, duplicate, too large) is drained when small enough to keep the connection in sync,
otherwise the connection is closed after the error frame. Other connections are never affected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from kvpool.kvstore.errors import (
    BadRequestError,
    CorruptObjectError,
    ProtocolError,
    StoreError,
    TransportTimeoutError,
    TransportUnavailableError,
    UnauthenticatedError,
)
from kvpool.kvstore.node.object_store import ObjectStore
from kvpool.kvstore.protocol.data_frame import (
    FLAG_ABORT,
    FLAG_EXISTS,
    HEADER_SIZE,
    OP_GET,
    OP_LOCATE,
    OP_PING,
    OP_PUT,
    OP_RESERVE,
    RESPONSE,
    Frame,
    FrameError,
    ShmExtent,
    decode_header,
    encode,
    error_frame,
)
from kvpool.kvstore.transport.base import (
    FLAG_TRAILER,
    recv_exactly_into,
    recv_hashing_into,
    send_hashing,
)
from kvpool.proto import common_pb2, node_pb2
from kvpool.runtime import cluster_auth

log = logging.getLogger(__name__)
DRAIN_LIMIT = 64 << 20  # refused payloads up to this size are read and dropped to keep the stream in sync
SEND_CHUNK = 1 << 20  # a GET payload is hashed, then sent, this much at a time (still in L2 when sent)


def _wire_len(frame: Frame) -> int:
    """Bytes that follow a PUT header: the payload, and the trailer frame when the writer sends one."""
    return frame.payload_len + (HEADER_SIZE if frame.flags & FLAG_TRAILER else 0)


class _CloseConnection(Exception):
    """Stop serving this connection (after an error frame was sent where possible)."""


class TcpDataServer:
    """Accept loop plus one task per connection."""

    def __init__(
        self,
        store: ObjectStore,
        host: str,
        port: int,
        frame_timeout_s: float = 5.0,
        floor_rate: float = 100e6,
        shm_enabled: bool = False,
        reservation_ttl_s: float = 30.0,
    ) -> None:
        self.store = store
        self.shm_enabled = shm_enabled
        self.reservation_ttl_s = reservation_ttl_s
        self.frame_timeout_s = frame_timeout_s
        self.floor_rate = floor_rate
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(256)
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._tasks: set[asyncio.Task] = set()
        self._accept_task: asyncio.Task | None = None
        self._scratch = bytearray(1 << 20)
        self.auth = cluster_auth.server_hello_check("node tcp")  # None: no cluster secret configured

    def start(self) -> None:
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def close(self) -> None:
        if self._accept_task:
            self._accept_task.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _addr = await loop.sock_accept(self._sock)
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _deadline(self, size: int) -> float:
        return self.frame_timeout_s + size / self.floor_rate

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        header = bytearray(HEADER_SIZE)
        hview = memoryview(header)
        try:
            if self.auth is not None and not await self._authenticated(loop, conn):
                return
            while True:
                # idle wait for the first byte has no deadline (pooled connections sit idle); the rest of
                # the frame must follow within the frame deadline
                n = await loop.sock_recv_into(conn, hview)
                if n == 0:
                    return
                if n < HEADER_SIZE:  # (no timer for the usual case: the whole header came in one piece)
                    try:
                        async with asyncio.timeout(self.frame_timeout_s):
                            await recv_exactly_into(loop, conn, hview[n:])
                    except TimeoutError:
                        await self._send_error(conn, 0, TransportTimeoutError("truncated frame header"))
                        return
                try:
                    frame, key_len, aux_len = decode_header(header)
                    if frame.op & RESPONSE:
                        raise FrameError("response frame sent to the node")
                except FrameError as exc:
                    self.store.count("frames_rejected")
                    await self._send_error(conn, 0, ProtocolError(str(exc)))
                    return
                try:
                    async with asyncio.timeout(self._deadline(frame.payload_len)):
                        var = bytearray(key_len + aux_len)
                        await recv_exactly_into(loop, conn, memoryview(var))
                        frame.key, frame.aux = bytes(var[:key_len]), bytes(var[key_len:])
                        await self._dispatch(loop, conn, frame)
                except TimeoutError:
                    self.store.count("frames_timed_out")
                    await self._send_error(
                        conn, frame.op, TransportTimeoutError("frame did not complete in time")
                    )
                    return
        except (_CloseConnection, ProtocolError, ConnectionError, OSError):
            return
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must cost one connection, never the node
            log.exception("tcp connection failed")
        finally:
            conn.close()

    async def _authenticated(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bool:
        """The connection's first bytes are the cluster hello (``runtime.cluster_auth``), within the frame
        deadline; anything else is answered with an ``UnauthenticatedError`` frame (the client raises it,
        saying where it reads its secret) and closed before a frame is read."""
        assert self.auth is not None
        hello = bytearray(cluster_auth.HELLO_SIZE)
        view = memoryview(hello)
        magic = len(cluster_auth.HELLO_MAGIC)
        try:
            async with asyncio.timeout(self.frame_timeout_s):
                await recv_exactly_into(loop, conn, view[:magic])
                if not cluster_auth.HelloCheck.cannot_be_hello(bytes(hello[:magic])):  # else refuse now
                    await recv_exactly_into(loop, conn, view[magic:])
                else:
                    hello = hello[:magic]
        except (TimeoutError, ProtocolError):
            hello = bytearray()
        peer = ":".join(map(str, conn.getpeername()[:2])) if conn.fileno() >= 0 else "?"
        why = self.auth.refusal(bytes(hello), peer)
        if why is None:
            return True
        self.store.count("auth_rejected")
        refused = UnauthenticatedError(f"the storage node refused the connection: {why}")
        await self._send_error(conn, 0, refused)
        await self._drain_until_closed(loop, conn)
        return False

    async def _drain_until_closed(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        """Half-close, then read and drop until the peer closes (bounded by the frame deadline): closing with
        the peer's request unread would reset the connection, and a reset can discard the answer sent."""
        with contextlib.suppress(OSError, TimeoutError):
            conn.shutdown(socket.SHUT_WR)
            async with asyncio.timeout(self.frame_timeout_s):
                while await loop.sock_recv(conn, 1 << 16):
                    pass

    async def _send_error(self, conn: socket.socket, op: int, exc: StoreError, request_id: int = 0) -> None:
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(1.0):
                await asyncio.get_running_loop().sock_sendall(
                    conn, encode(error_frame(op or OP_PING, exc.code, str(exc), request_id))
                )

    async def _dispatch(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, frame: Frame) -> None:
        if frame.op == OP_PING:
            await loop.sock_sendall(conn, encode(Frame(OP_PING | RESPONSE, request_id=frame.request_id)))
        elif frame.op == OP_PUT:
            await self._put(loop, conn, frame)
        elif frame.op == OP_GET:
            await self._get(loop, conn, frame)
        else:
            await self._shm_control(loop, conn, frame)

    async def _shm_control(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, frame: Frame) -> None:
        """LOCATE / RESERVE / SEAL for the shm transport: ~0.1 ms here vs ~0.4 ms per gRPC call.

        Replies that name a readable object (LOCATE, SEAL, RESERVE of a key already here) carry its stamp
        slot and generation, which the reader keeps to skip LOCATE next time (``protocol/shm_segment``).
        """
        if frame.payload_len:
            await self._send_error(conn, frame.op, ProtocolError("shm control frames carry no payload"))
            raise _CloseConnection
        reply = Frame(frame.op | RESPONSE, request_id=frame.request_id)
        name = self.store.pool.name

        def stamped(key: bytes) -> None:  # reply describes the readable object under key (if in DRAM)
            obj = self.store.objects.get(key)
            if obj is not None and obj.extent is not None and not obj.doomed:
                ext = ShmExtent(name, obj.extent.offset, obj.extent.size, obj.slot, obj.generation)
                reply.aux, reply.checksum = ext.pack(), obj.meta.checksum

        try:
            if not self.shm_enabled:
                raise TransportUnavailableError("this node does not export its pool over shm")
            if frame.op == OP_LOCATE:
                await self.store.locate(frame.key)
                stamped(frame.key)  # locate() leaves the object in DRAM (no await since)
            elif frame.op == OP_RESERVE:
                header = _put_header(frame.aux)
                pending = self.store.reserve(header.put_id, header.meta, self.reservation_ttl_s)
                if pending is None:
                    reply.flags = FLAG_EXISTS
                    stamped(header.meta.key)
                else:
                    reply.aux = ShmExtent(name, pending.extent.offset, pending.extent.size).pack()
            else:  # OP_SEAL
                put_id = frame.aux.decode(errors="replace")
                sealing = self.store.pending.get(put_id)
                abort = bool(frame.flags & FLAG_ABORT)
                self.store.seal(put_id, abort=abort, checksum=frame.checksum)
                if sealing is not None and not abort:
                    stamped(sealing.meta.key)
        except StoreError as exc:
            await self._send_error(conn, frame.op, exc, frame.request_id)
            return
        await loop.sock_sendall(conn, encode(reply))

    async def _put(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, frame: Frame) -> None:
        header = node_pb2.PutHeader()
        try:
            header.ParseFromString(frame.aux)
            if header.meta.size != frame.payload_len or header.meta.checksum != frame.checksum:
                raise BadRequestError("frame and PutHeader disagree on size or checksum")
            if bool(frame.flags & FLAG_TRAILER) == bool(frame.checksum):
                raise BadRequestError("a put declares its checksum once: in its header or in a trailer")
            pending = self.store.begin_put(header.put_id, header.meta)
        except StoreError as exc:
            await self._refuse_payload(loop, conn, frame, exc)
            return
        except Exception as exc:  # protobuf DecodeError
            await self._refuse_payload(loop, conn, frame, BadRequestError(f"bad PutHeader: {exc}"))
            return
        if pending is None:  # duplicate of an object already here
            await self._drain(loop, conn, _wire_len(frame))
            await loop.sock_sendall(conn, encode(Frame(OP_PUT | RESPONSE, request_id=frame.request_id)))
            return
        try:
            pending.landed_checksum = await recv_hashing_into(
                loop, conn, self.store.pool.view(pending.extent)
            )
            if frame.flags & FLAG_TRAILER:  # the writer hashed while sending: its digest follows the bytes
                pending.meta.checksum = await self._put_trailer(loop, conn, frame.request_id)
        except BaseException:
            self.store.abort_put(pending)
            raise
        try:
            self.store.finish_put(pending)
        except StoreError as exc:
            await self._send_error(conn, OP_PUT, exc, frame.request_id)
            return
        await loop.sock_sendall(conn, encode(Frame(OP_PUT | RESPONSE, request_id=frame.request_id)))

    async def _put_trailer(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, request_id: int
    ) -> int:
        """The checksum a streaming writer declares after its payload (a bare 48-byte PUT frame)."""
        buf = bytearray(HEADER_SIZE)
        await recv_exactly_into(loop, conn, memoryview(buf))
        trailer, key_len, aux_len = decode_header(buf)
        bare = not (key_len or aux_len or trailer.payload_len)
        if trailer.op != OP_PUT or trailer.request_id != request_id or not bare:
            raise ProtocolError("a put's trailer must be a bare PUT frame with the same request id")
        if not trailer.checksum:
            raise ProtocolError("a put's trailer declares no checksum")
        return trailer.checksum

    async def _refuse_payload(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, frame: Frame, exc: StoreError
    ) -> None:
        if frame.payload_len > DRAIN_LIMIT:
            await self._send_error(conn, OP_PUT, exc, frame.request_id)
            raise _CloseConnection
        await self._drain(loop, conn, _wire_len(frame))
        await self._send_error(conn, OP_PUT, exc, frame.request_id)

    async def _drain(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, n: int) -> None:
        scratch = memoryview(self._scratch)
        while n > 0:
            got = await loop.sock_recv_into(conn, scratch[: min(n, len(scratch))])
            if got == 0:
                raise ProtocolError("connection closed inside a payload")
            n -= got

    async def _get(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, frame: Frame) -> None:
        try:
            obj = await self.store.acquire(frame.key)
        except StoreError as exc:
            await self._send_error(conn, OP_GET, exc, frame.request_id)
            return
        try:
            try:
                if obj.meta.size > frame.payload_len:
                    raise BadRequestError(
                        f"object is {obj.meta.size} B, the reader's buffer {frame.payload_len} B"
                    )
                data = memoryview(await self.store.read(obj, verify=False))  # verified as it streams
            except StoreError as exc:
                await self._send_error(conn, OP_GET, exc, frame.request_id)
                return
            await self._stream(loop, conn, frame.request_id, obj.meta, data)
        finally:
            self.store.release(obj)

    async def _stream(
        self,
        loop: asyncio.AbstractEventLoop,
        conn: socket.socket,
        request_id: int,
        meta: common_pb2.ObjectMeta,
        data: memoryview,
    ) -> None:
        """Header, payload, trailer. Each ``SEND_CHUNK`` is hashed just before it is sent, so the first byte
        leaves at once instead of after a whole-object hash, and the send copies bytes the hash just pulled
        into cache. The trailer carries the verdict: a copy that fails its checksum here is reported as
        ``CorruptObjectError`` (counted as today); the reader also verifies end to end on its own."""
        head = Frame(
            OP_GET | RESPONSE,
            flags=FLAG_TRAILER,
            request_id=request_id,
            payload_len=len(data),
            checksum=meta.checksum,
        )

        def verdict(digest: int) -> bytes:
            if digest == meta.checksum:
                return encode(Frame(OP_GET | RESPONSE, request_id=request_id, checksum=digest))
            self.store.count("reads_corrupt")
            msg = f"key {meta.key[:8].hex()}… failed its checksum on the node"
            trailer = error_frame(OP_GET, CorruptObjectError.code, msg, request_id)
            trailer.checksum = digest
            return encode(trailer)

        await send_hashing(loop, conn, encode(head), data, SEND_CHUNK, verdict)


def _put_header(aux: bytes) -> node_pb2.PutHeader:
    header = node_pb2.PutHeader()
    try:
        header.ParseFromString(aux)
    except Exception as exc:
        raise BadRequestError(f"bad PutHeader: {exc}") from exc
    return header
