"""The bytes of one HiCache page object: a short checked header, then the page exactly as SGLang holds it.

``b"KVPH" | u32 header length | msgpack {"v", "fmt", "n"} | payload``. ``fmt`` names the page's byte format
(the pool, its layout and dtype: a ``layer_first`` page and a ``page_first`` page of the same tokens hold
their bytes in another order), ``n`` the payload length. The payload is the page's flat bytes, which are
the same whether SGLang moves them by ``get_data_page`` (the generic path) or by the pointers of
``get_page_buffer_meta`` (the zero-copy v1/v2 paths): one page written by either is read by both.

Integrity: the store's checksum (xxh3-64 of the whole object, computed by the put while copying) covers
header and payload; the reader hashes what it copies into SGLang's memory in the same pass and compares
(``Reader`` in ``hicache.py``). A header of another format or length is ``BadPageError``: a miss.
"""

from __future__ import annotations

import struct

import msgpack

MAGIC = b"KVPH"
VERSION = 1
_PREFIX = struct.Struct("<4sI")


class BadPageError(ValueError):
    """A stored page is not what the reader expects (another format or size, truncated or damaged)."""


def header(fmt: str, nbytes: int) -> bytes:
    body = msgpack.packb({"v": VERSION, "fmt": fmt, "n": nbytes})
    return _PREFIX.pack(MAGIC, len(body)) + body


def payload_offset(view: memoryview, fmt: str, nbytes: int) -> int:
    """Where the payload of ``view`` starts, after checking its header against what the reader expects."""
    if len(view) < _PREFIX.size:
        raise BadPageError("object shorter than its prefix")
    magic, hlen = _PREFIX.unpack_from(view)
    start = _PREFIX.size + hlen
    if magic != MAGIC or start > len(view):
        raise BadPageError("not a kvpool HiCache page")
    try:
        h = msgpack.unpackb(view[_PREFIX.size : start])
    except (ValueError, msgpack.UnpackException) as exc:
        raise BadPageError(f"unreadable header: {exc}") from None
    if not isinstance(h, dict) or h.get("v") != VERSION:
        raise BadPageError("unknown page version")
    if h.get("fmt") != fmt:
        raise BadPageError(f"page of format {h.get('fmt')!r}, expected {fmt!r}")
    if h.get("n") != nbytes or len(view) - start != nbytes:
        raise BadPageError(f"page of {len(view) - start} B, expected {nbytes} B")
    return start
