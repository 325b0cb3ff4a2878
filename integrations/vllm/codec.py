"""The bytes of one connector object: a checked header, then the blocks of every layer back to back.

``b"KVPV" | u32 header length | msgpack header | payload``. The header names the fingerprint, the object's
kind, and for every part (one layer's tensor, in a fixed order) its name and byte count, plus an xxh3-64
of the payload. ``open_object`` checks every header field against what the reader expects and hands back the
payload with the digest it must hash to; the reader hashes the payload and compares before it copies
anything into its blocks (``Loader._visit``). Any mismatch raises ``BadObjectError``, which the connector
turns into a load error for vLLM to recompute: a bad object is a miss, never wrong KV.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import xxhash

MAGIC = b"KVPV"
VERSION = 1
_PREFIX = struct.Struct("<4sI")


class BadObjectError(ValueError):
    """A stored object does not hold what the reader expects (truncated, foreign, or corrupted)."""


@dataclass(frozen=True, slots=True)
class Part:
    name: str  # layer name (and tensor index for layers with several state tensors)
    nbytes: int


def payload_digest(payload: Sequence[memoryview]) -> int:
    """The xxh3-64 of the payload parts, concatenated (what the header's ``xxh`` holds)."""
    digest = xxhash.xxh3_64()
    for b in payload:
        digest.update(b)
    return digest.intdigest()


def encode(fp: bytes, kind: int, parts: Sequence[Part], payload: Sequence[memoryview]) -> list[memoryview]:
    """One object from its parts' bytes (``payload[i]`` holds ``parts[i].nbytes`` bytes), as buffers in
    order: the prefix and header, then the payload parts themselves (a put copies them straight into the
    store, so they are never joined here)."""
    if len(parts) != len(payload) or any(p.nbytes != len(b) for p, b in zip(parts, payload, strict=True)):
        raise ValueError("every part needs exactly its stated bytes")
    header = msgpack.packb(
        {
            "v": VERSION,
            "fp": fp,
            "kind": kind,
            "parts": [[p.name, p.nbytes] for p in parts],
            "xxh": payload_digest(payload),
        }
    )
    return [memoryview(_PREFIX.pack(MAGIC, len(header)) + header), *payload]


def open_object(
    data: bytes | memoryview, fp: bytes, kind: int, parts: Sequence[Part]
) -> tuple[memoryview, int]:
    """The payload of ``data`` and the xxh3-64 it must hash to, after checking that its header is exactly
    the object the reader expects. The payload itself is not read here: the caller hashes it as it moves it
    and compares (``BadObjectError("payload checksum mismatch")`` on a difference)."""
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise BadObjectError("object shorter than its prefix")
    magic, hlen = _PREFIX.unpack_from(view)
    if magic != MAGIC or _PREFIX.size + hlen > len(view):
        raise BadObjectError("not a kvpool vLLM object")
    try:
        header = msgpack.unpackb(view[_PREFIX.size : _PREFIX.size + hlen])
    except (ValueError, msgpack.UnpackException) as exc:
        raise BadObjectError(f"unreadable header: {exc}") from None
    if not isinstance(header, dict) or header.get("v") != VERSION:
        raise BadObjectError("unknown object version")
    if header.get("fp") != fp or header.get("kind") != kind:
        raise BadObjectError("object of another model, layout or kind")
    if header.get("parts") != [[p.name, p.nbytes] for p in parts]:
        raise BadObjectError("object's layers or sizes differ from this engine's")
    payload = view[_PREFIX.size + hlen :]
    if len(payload) != sum(p.nbytes for p in parts):
        raise BadObjectError("payload length differs from its header")
    digest = header.get("xxh")
    if not isinstance(digest, int):
        raise BadObjectError("header without a payload checksum")
    return payload, digest
