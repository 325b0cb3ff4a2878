"""The layout every cache unit shares: ``MAGIC | u32 header length | msgpack header | padding | payload``.

The plan of a unit (its header and 64-byte-aligned tensor segments) is derived from the reader's
``CacheSchema`` and the unit's identity; ``write_unit`` lays it out and ``open_unit`` validates a buffer
completely (structure, version, checksum, kind, model, schema) before any tensor is viewed. The codecs of
the three unit kinds are in ``units``.
"""

from __future__ import annotations

import struct
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import xxhash
from kvpool.cache.errors import (
    CacheUnitError,
    CorruptUnitError,
    FingerprintMismatchError,
    PositionMismatchError,
    SchemaMismatchError,
    UnsupportedVersionError,
)
from kvpool.cache.hashing import canonical_tokens
from kvpool.kvstore.keys import HASH_BYTES
from kvpool.model.cache_schema import FORMAT_VERSION, INDEX_KEY_FORMATS, CacheSchema
from kvpool.model.state import KDACheckpoint, KDALayerState

MAGIC = b"KVPU"
PREFIX = struct.Struct("<4sI")  # magic, header length
ALIGN = 64  # payload and every segment start on a 64-byte boundary: safe zero-copy views, DMA-friendly
MAX_HEADER_BYTES = 1 << 20  # a sane header is a few hundred bytes (+ < block_size tail tokens)
CSUM_BYTES = 8  # the header's last 8 bytes are the raw xxh3-64 digest (msgpack bin8 of fixed width)
KIND_MLA, KIND_KDA, KIND_TAIL = "mla", "kda", "tail"

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Segment:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # within the payload

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass
class UnitPlan:
    """Everything about a unit except tensor bytes and checksum: derived from the schema and identity fields
    alone, so the writer and the reader construct the very same header."""

    header: dict[str, Any]
    segments: list[Segment] = field(default_factory=list)
    header_bytes: bytes = b""
    payload_offset: int = 0
    payload_len: int = 0

    @property
    def total(self) -> int:
        return self.payload_offset + self.payload_len


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def dtype_named(name: str) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise SchemaMismatchError(f"unknown dtype name {name!r}")
    return dt


def checked_int(value: Any, what: str, multiple_of: int = 1) -> int:
    if type(value) is not int or value < 0 or value % multiple_of:
        raise ValueError(f"{what} must be a non-negative int multiple of {multiple_of}, got {value!r}")
    return value


def hash_field(block_hash: Any) -> bytes | None:
    if block_hash is None:
        return None
    if not isinstance(block_hash, bytes | bytearray) or len(block_hash) != HASH_BYTES:
        raise ValueError(f"block hash must be {HASH_BYTES} bytes or None")
    return bytes(block_hash)


def mla_section(s: CacheSchema, rows: int) -> dict[str, Any]:
    sec: dict[str, Any] = {"layers": list(s.mla_layers), "dtype": s.mla_dtype, "shape": [rows, s.latent_dim]}
    if s.dsa:  # only DSA units have this key, so a dense unit's header is byte-identical to format v1's
        if s.index_dtype not in INDEX_KEY_FORMATS:
            raise SchemaMismatchError(f"unknown indexer key storage {s.index_dtype!r}")
        sec["indexer"] = {
            "dim": s.index_dim,
            "dtype": s.index_dtype,
            "scale": "float32" if s.index_dtype == "float8_e4m3fn" else None,  # power of two, per token
            "row_bytes": s.mla_row_bytes,  # each row: latent bytes, then the key record
        }
    return sec


def mla_segment(s: CacheSchema, rows: int) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of one MLA layer's payload: typed latents, or DSA byte records ``[latent | key]``."""
    if s.dsa:
        return (rows, s.mla_row_bytes), torch.uint8
    return (rows, s.latent_dim), dtype_named(s.mla_dtype)


def kda_section(s: CacheSchema) -> dict[str, Any]:
    return {
        "layers": list(s.kda_layers),
        "state_dtype": "float32",
        "state_shape": list(s.state_shape),
        "layout": s.state_layout,
        "conv_dtype": s.conv_dtype,
        "conv_shape": list(s.conv_shape),
        "conv_taps": s.conv_taps,
    }


def plan_unit(
    s: CacheSchema,
    kind: str,
    *,
    block: int | None = None,
    n_tokens: int | None = None,
    start: int | None = None,
    tokens: list[int] | None = None,
    block_hash: bytes | None = None,
) -> UnitPlan:
    """Header + segment layout for one unit. Raises ``ValueError`` for impossible identity fields."""
    b = s.block_size
    mla: dict[str, Any] | None = None
    kda: dict[str, Any] | None = None
    if kind == KIND_MLA:
        block = checked_int(block, "block index")
        start, n_tokens = block * b, (block + 1) * b
        mla = mla_section(s, b)
    elif kind == KIND_KDA:
        n_tokens = checked_int(n_tokens, "checkpoint n_tokens", b)
        if n_tokens == 0:
            raise ValueError("a stored KDA checkpoint sits at the end of a block: n_tokens > 0")
        kda = kda_section(s)
    elif kind == KIND_TAIL:
        start = checked_int(start, "tail start", b)
        if not isinstance(tokens, list) or len(tokens) >= b:
            raise ValueError(f"tail tokens must be a list shorter than block_size={b}")
        n_tokens = start + len(tokens)
        mla, kda = mla_section(s, len(tokens)), kda_section(s)
    else:
        raise ValueError(f"unknown unit kind {kind!r}")
    header: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "kind": kind,
        "fp": bytes(s.fingerprint),
        "bs": b,
        "block": block,
        "start": start,
        "n_tokens": n_tokens,
        "hash": hash_field(block_hash),
        "tokens": tokens,
        "mla": mla,
        "kda": kda,
    }
    plan = UnitPlan(header)
    off = 0

    def add(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        nonlocal off
        seg = Segment(name, tuple(shape), dtype, off)
        plan.segments.append(seg)
        off = align_up(off + seg.nbytes)

    if mla is not None:
        shape, dtype = mla_segment(s, mla["shape"][0])
        for layer in s.mla_layers:
            add(f"mla[{layer}]", shape, dtype)
    if kda is not None:
        for layer in s.kda_layers:
            add(f"kda[{layer}].recurrent", tuple(s.state_shape), torch.float32)
            add(f"kda[{layer}].conv", tuple(s.conv_shape), dtype_named(s.conv_dtype))
    plan.payload_len = plan.segments[-1].offset + plan.segments[-1].nbytes if plan.segments else 0
    header["plen"] = plan.payload_len
    header["csum"] = bytes(CSUM_BYTES)  # must stay the last key: its 8 bytes end the header
    plan.header_bytes = msgpack.packb(header, use_bin_type=True)
    plan.payload_offset = align_up(PREFIX.size + len(plan.header_bytes))
    return plan


def check_tensor(seg: Segment, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise SchemaMismatchError(f"{seg.name}: expected a tensor, got {type(t).__name__}")
    if tuple(t.shape) != seg.shape or t.dtype != seg.dtype:
        raise SchemaMismatchError(
            f"{seg.name}: got {tuple(t.shape)} {t.dtype}, schema wants {seg.shape} {seg.dtype}"
        )
    return t


def check_layers(what: str, got: dict[int, Any], want: tuple[int, ...]) -> None:
    if sorted(got) != list(want):
        raise SchemaMismatchError(f"{what} layers {sorted(got)} != schema {list(want)}")


def write_unit(plan: UnitPlan, tensors: list[torch.Tensor], out: Buffer | None) -> bytearray | memoryview:
    """Lay the unit out in ``out`` (or a new bytearray): prefix, header, zero padding, tensors, checksum."""
    if sys.byteorder != "little":
        raise CacheUnitError("the wire format is little-endian; big-endian hosts are not supported")
    total = plan.total
    if out is None:
        result: bytearray | memoryview = bytearray(total)  # zero-filled
        mv = memoryview(result)
    else:
        mv = memoryview(out)
        if mv.readonly or mv.nbytes < total or not mv.c_contiguous:
            raise ValueError(f"out must be a writable contiguous buffer of at least {total} bytes")
        mv = mv.cast("B")[:total]
        result = mv
    hlen = len(plan.header_bytes)
    PREFIX.pack_into(mv, 0, MAGIC, hlen)
    mv[PREFIX.size : PREFIX.size + hlen] = plan.header_bytes
    dst = torch.frombuffer(mv, dtype=torch.uint8)
    pos = PREFIX.size + hlen
    for seg, t in zip(plan.segments, tensors, strict=True):
        begin = plan.payload_offset + seg.offset
        if out is not None:
            dst[pos:begin].zero_()  # padding is checksummed, so it must be deterministic
        if seg.nbytes:
            dst[begin : begin + seg.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        pos = begin + seg.nbytes
    if out is not None:
        dst[pos:total].zero_()
    end_h = PREFIX.size + hlen
    digest = unit_checksum(mv, end_h)
    mv[end_h - CSUM_BYTES : end_h] = digest
    return result


def unit_parts(plan: UnitPlan, tensors: list[torch.Tensor]) -> list[bytes | bytearray | memoryview]:
    """The unit ``write_unit`` lays out, as parts in order (prefix + header, zero padding, each tensor's
    bytes where it lies): their concatenation is byte for byte ``write_unit``'s buffer. A store put copies
    or sends the parts straight from the tensors, so the unit is never assembled in a buffer of its own.
    The tensors must stay unchanged until the put returns (the parts view their memory)."""
    if sys.byteorder != "little":
        raise CacheUnitError("the wire format is little-endian; big-endian hosts are not supported")
    hlen = len(plan.header_bytes)
    head = bytearray(PREFIX.size + hlen)
    PREFIX.pack_into(head, 0, MAGIC, hlen)
    head[PREFIX.size :] = plan.header_bytes
    parts: list[bytes | bytearray | memoryview] = [head]
    pos = len(head)
    for seg, t in zip(plan.segments, tensors, strict=True):
        begin = plan.payload_offset + seg.offset
        if begin > pos:
            parts.append(bytes(begin - pos))  # padding is checksummed: zeros, as write_unit leaves them
        if seg.nbytes:
            host = t.detach() if t.device.type == "cpu" else t.detach().to("cpu")  # a GPU prefill's tensors
            raw = host.contiguous().reshape(-1).view(torch.uint8)
            parts.append(memoryview(raw.numpy()))
        pos = begin + seg.nbytes
    if plan.total > pos:
        parts.append(bytes(plan.total - pos))
    h = xxhash.xxh3_64()
    h.update(memoryview(head)[: len(head) - CSUM_BYTES])
    for part in parts[1:]:
        h.update(part)
    head[len(head) - CSUM_BYTES :] = h.digest()
    return parts


def unit_checksum(mv: memoryview, header_end: int) -> bytes:
    h = xxhash.xxh3_64()
    h.update(mv[: header_end - CSUM_BYTES])
    h.update(mv[header_end:])
    return h.digest()


def mla_tensors(plan: UnitPlan, schema: CacheSchema, latents: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    check_layers("MLA", latents, schema.mla_layers)
    segs = [seg for seg in plan.segments if seg.name.startswith("mla[")]
    return [check_tensor(seg, latents[layer]) for seg, layer in zip(segs, schema.mla_layers, strict=True)]


def kda_tensors(plan: UnitPlan, schema: CacheSchema, ckpt: KDACheckpoint) -> list[torch.Tensor]:
    check_layers("KDA", ckpt.layers, schema.kda_layers)
    segs = [seg for seg in plan.segments if seg.name.startswith("kda[")]
    tensors: list[torch.Tensor] = []
    for i, layer in enumerate(schema.kda_layers):
        st = ckpt.layers[layer]
        tensors.append(check_tensor(segs[2 * i], st.recurrent))
        tensors.append(check_tensor(segs[2 * i + 1], st.conv))
    return tensors


def open_unit(buf: Buffer, schema: CacheSchema, kind: str) -> tuple[memoryview, UnitPlan]:
    """Validate a unit completely (structure, version, checksum, kind, model, schema, header consistency)."""
    try:
        mv = memoryview(buf)
        mv = mv.cast("B") if (mv.ndim != 1 or mv.itemsize != 1) else mv
    except (TypeError, ValueError) as e:
        raise CorruptUnitError(f"not a contiguous byte buffer: {e}") from e
    if mv.nbytes < PREFIX.size:
        raise CorruptUnitError(f"truncated: {mv.nbytes} bytes")
    magic, hlen = PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptUnitError(f"bad magic {bytes(magic)!r}")
    end_h = PREFIX.size + hlen
    if hlen < CSUM_BYTES or hlen > MAX_HEADER_BYTES or end_h > mv.nbytes:
        raise CorruptUnitError(f"bad header length {hlen} for a {mv.nbytes}-byte unit")
    raw = bytes(mv[PREFIX.size : end_h])
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for malformed input
        raise CorruptUnitError(f"unparsable header: {type(e).__name__}: {e}") from e
    if not isinstance(header, dict):
        raise CorruptUnitError("header is not a map")
    version = header.get("v")
    if type(version) is not int:
        raise CorruptUnitError("header has no version")
    if version != FORMAT_VERSION:
        raise UnsupportedVersionError(f"unit format version {version}, reader supports {FORMAT_VERSION}")
    plen, csum = header.get("plen"), header.get("csum")
    if not isinstance(csum, bytes) or csum != raw[-CSUM_BYTES:] or type(plen) is not int:
        raise CorruptUnitError("header checksum field malformed")
    if mv.nbytes != align_up(end_h) + plen:
        raise CorruptUnitError(f"unit is {mv.nbytes} bytes, header says {align_up(end_h) + plen}")
    if unit_checksum(mv, end_h) != csum:
        raise CorruptUnitError("checksum mismatch")
    # Intact: from here on a difference is the reader's business (wrong model / layout / position).
    if header.get("kind") != kind:
        raise SchemaMismatchError(f"unit kind {header.get('kind')!r}, expected {kind!r}")
    if header.get("fp") != schema.fingerprint:
        raise FingerprintMismatchError("unit was written by a model with another fingerprint")
    if header.get("bs") != schema.block_size:
        raise SchemaMismatchError(f"block_size {header.get('bs')!r} != schema {schema.block_size}")
    try:
        tokens = header.get("tokens")
        plan = plan_unit(
            schema,
            kind,
            block=header.get("block"),
            n_tokens=header.get("n_tokens"),
            start=header.get("start"),
            tokens=canonical_tokens(tokens) if isinstance(tokens, list) else tokens,
            block_hash=header.get("hash"),
        )
    except ValueError as e:
        raise CorruptUnitError(f"inconsistent header: {e}") from e
    for sec in ("mla", "kda"):
        got, want = header.get(sec), plan.header[sec]
        if (got is None) != (want is None) or not isinstance(got, dict | None):
            raise CorruptUnitError(f"header section {sec!r} malformed")
        for key in sorted(set(want or {}) | set(got or {})):  # a missing/extra "indexer" is a schema clash
            if got.get(key) != want.get(key):
                raise SchemaMismatchError(
                    f"{sec}.{key}: unit has {got.get(key)!r}, schema has {want.get(key)!r}"
                )
    if plan.header_bytes[:-CSUM_BYTES] != raw[:-CSUM_BYTES]:
        raise CorruptUnitError("header differs from the canonical header for its fields")
    return mv, plan


def unit_tensors(mv: memoryview, plan: UnitPlan, copy: bool) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers: views are documented read-only
        for seg in plan.segments:
            if seg.nbytes == 0:
                out.append(torch.empty(seg.shape, dtype=seg.dtype))
                continue
            numel = seg.nbytes // seg.dtype.itemsize
            t = torch.frombuffer(mv, dtype=seg.dtype, count=numel, offset=plan.payload_offset + seg.offset)
            t = t.view(seg.shape)
            out.append(t.clone() if copy else t)
    return out


def expect_equal(what: str, got: Any, want: Any) -> None:
    if want is not None and got != want:
        raise PositionMismatchError(f"{what}: unit has {got!r}, caller expects {want!r}")


def kda_from(schema: CacheSchema, n_tokens: int, tensors: list[torch.Tensor]) -> KDACheckpoint:
    layers = {
        layer: KDALayerState(recurrent=tensors[2 * i], conv=tensors[2 * i + 1])
        for i, layer in enumerate(schema.kda_layers)
    }
    return KDACheckpoint(n_tokens=n_tokens, layers=layers)
