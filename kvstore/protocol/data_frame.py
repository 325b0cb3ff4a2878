"""The data-plane frame shared by the tcp and ucx transports (client and node side).

A fixed 48-byte little-endian header, then ``key`` and ``aux`` bytes, then ``payload_len`` payload bytes:

    magic "KVP1" | op u8 | status u8 | flags u16 | key_len u16 | aux_len u16 | reserved u32
    | request_id u64 | payload_len u64 | checksum u64 | reserved u64

* PUT request: key, aux = ``PutHeader`` (put_id + ObjectMeta, protobuf), payload = object bytes.
* GET request: key, ``payload_len`` = capacity of the caller's buffer (the node refuses larger objects
  instead of sending bytes nobody can receive).
* Responses set ``op |= RESPONSE``; ``status`` is 0 or an error code from ``kvpool.kvstore.errors``, with the
  message in aux. A GET response carries the payload and its checksum.
* shm control (no payload): LOCATE, RESERVE and SEAL replies carry ``EXTENT`` = (offset, size, slot,
  generation) followed by the segment name in aux (see ``ShmExtent``); generation 0 = no stamp (RESERVE of a
  not yet readable put, or the node ran out of stamp slots). A reader keeps (segment, offset, size, slot,
  generation) as a hint and later validates it against the node's stamp table (``shm_segment``) instead of
  sending LOCATE again. Node and client are in this repo and change in lockstep.

Fixed sizes let the node reject garbage after 48 bytes and let ucx receive control messages into one
preallocated buffer (ucx tag receives must know the length).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvpool.kvstore.errors import StoreError, UnauthenticatedError, error_for_code
from kvpool.runtime import cluster_auth

MAGIC = b"KVP1"
HEADER = struct.Struct("<4sBBHHHIQQQQ")
HEADER_SIZE = HEADER.size  # 48
MAX_KEY = 1024
MAX_AUX = 3000
CONTROL_SIZE = 4096  # ucx control message: header + key + aux, zero padded

OP_PUT = 1
OP_GET = 2
OP_PING = 3
# shm control (payload-less): where an object lies in the pool, reserve an extent for a put, seal/abort it
OP_LOCATE = 4  # key → aux = EXTENT + shm name, checksum = the object's
# aux = PutHeader → aux = EXTENT (generation 0: not readable yet) + shm name; flags FLAG_EXISTS = nothing to
# copy (aux then describes the copy already there when it is in DRAM, else is empty; checksum = its checksum)
OP_RESERVE = 5
# aux = put_id; flags FLAG_ABORT = free the reservation instead; reply aux = EXTENT + shm name of the sealed
# object (so a put leaves a read hint behind), checksum = its checksum; empty aux for an abort
OP_SEAL = 6
RESPONSE = 0x80
OPS = (OP_PUT, OP_GET, OP_PING, OP_LOCATE, OP_RESERVE, OP_SEAL)
FLAG_EXISTS = 1  # RESERVE reply: the node already holds this object, nothing to copy
FLAG_ABORT = 1  # SEAL request: free the reservation instead of publishing it
# (bit 4 is the tcp transport's trailer flag, FLAG_TRAILER)
EXTENT = struct.Struct("<QQQQ")  # offset, size, stamp slot, generation (0 = no stamp)

STATUS_OK = 0
STATUS_READY = 0xFE  # ucx put: node reserved the extent, send the payload


@dataclass
class Frame:
    """One decoded header plus its variable parts."""

    op: int
    status: int = 0
    key: bytes = b""
    aux: bytes = b""
    request_id: int = 0
    payload_len: int = 0
    checksum: int = 0
    flags: int = 0


class FrameError(ValueError):
    """The bytes are not a valid frame header."""


def encode(frame: Frame) -> bytes:
    """Header + key + aux as one bytes object (the payload is sent separately, zero-copy)."""
    if len(frame.key) > MAX_KEY or len(frame.aux) > MAX_AUX:
        raise FrameError(f"key ({len(frame.key)} B) or aux ({len(frame.aux)} B) too long")
    head = HEADER.pack(
        MAGIC,
        frame.op,
        frame.status,
        frame.flags,
        len(frame.key),
        len(frame.aux),
        0,
        frame.request_id,
        frame.payload_len,
        frame.checksum,
        0,
    )
    return head + frame.key + frame.aux


def decode_header(buf: bytes | bytearray | memoryview) -> tuple[Frame, int, int]:
    """Parse the fixed header: the frame (without key/aux) and the key and aux lengths to read next."""
    magic, op, status, flags, key_len, aux_len, _r, request_id, payload_len, checksum, _r2 = HEADER.unpack(
        bytes(buf[:HEADER_SIZE])
    )
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}")
    if (op & ~RESPONSE) not in OPS:
        raise FrameError(f"unknown op {op}")
    if key_len > MAX_KEY or aux_len > MAX_AUX:
        raise FrameError(f"key_len {key_len} / aux_len {aux_len} over the limits")
    frame = Frame(op, status, b"", b"", request_id, payload_len, checksum, flags)
    return frame, key_len, aux_len


def encode_control(frame: Frame) -> bytearray:
    """A frame padded to ``CONTROL_SIZE`` bytes (ucx control message)."""
    raw = encode(frame)
    out = bytearray(CONTROL_SIZE)
    out[: len(raw)] = raw
    return out


def decode_control(buf: bytes | bytearray | memoryview) -> Frame:
    """Parse a ``CONTROL_SIZE`` control message, key and aux included."""
    frame, key_len, aux_len = decode_header(buf)
    start = HEADER_SIZE
    frame.key = bytes(buf[start : start + key_len])
    frame.aux = bytes(buf[start + key_len : start + key_len + aux_len])
    return frame


@dataclass(frozen=True)
class ShmExtent:
    """Where an object lies in a node's shm segment, and its stamp (``generation`` 0 = none)."""

    segment: str
    offset: int
    size: int
    slot: int = 0
    generation: int = 0

    def pack(self) -> bytes:
        return EXTENT.pack(self.offset, self.size, self.slot, self.generation) + self.segment.encode()

    @classmethod
    def unpack(cls, aux: bytes) -> ShmExtent:
        if len(aux) <= EXTENT.size:
            raise FrameError(f"shm extent reply of {len(aux)} B carries no segment name")
        offset, size, slot, generation = EXTENT.unpack_from(aux)
        return cls(aux[EXTENT.size :].decode(), offset, size, slot, generation)


def error_frame(op: int, code: int, message: str, request_id: int = 0) -> Frame:
    """A response frame reporting ``code`` with a (truncated) message."""
    return Frame(op | RESPONSE, code, b"", message.encode()[:MAX_AUX], request_id)


def reported_error(frame: Frame) -> StoreError:
    """The typed error a node's error response stands for. A refusal of this process's cluster secret gets
    this process's side appended (which secret it has, where one is read from): the operator's fix."""
    message = frame.aux.decode(errors="replace")
    if frame.status == UnauthenticatedError.code:
        message = f"{message}; {cluster_auth.refusal_advice(message)}"
    return error_for_code(frame.status, message)
