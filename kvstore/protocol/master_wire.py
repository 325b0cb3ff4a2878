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

This module is the contract (header, method ids, errors); ``master_wire_server`` serves it on the master and
``master_wire_client`` speaks it for clients (which therefore import nothing of the master's own code).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass

import grpc
from google.protobuf.message import Message
from kvpool.kvstore.errors import StoreUnavailableError
from kvpool.proto import master_pb2

MAGIC = b"KVM1"
HEADER = struct.Struct("<4sBBHQI")
HEADER_SIZE = HEADER.size  # 20
MAX_BODY = 64 << 20
FRAME_TIMEOUT_S = 5.0  # a started frame must be complete within this
MAX_ERROR_BYTES = 4096
STATUS_OK = 0

STATUS_NUMBER = {code.name: code.value[0] for code in grpc.StatusCode}
STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


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
    return STATUS_NUMBER.get(code_name, grpc.StatusCode.UNKNOWN.value[0])


class FrameBuffer:
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


def no_delay(transport: asyncio.Transport) -> None:
    """TCP_NODELAY on an asyncio transport's socket: small frames must not wait for Nagle."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
