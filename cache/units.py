"""Wire format of cache units: MLA blocks, KDA checkpoints, request tails (docs/design/cache_units.md).

A unit is ``MAGIC | u32 header length (LE) | msgpack header | zero padding to 64 B | payload``. The payload is
the raw bytes of every tensor, each segment starting 64-byte aligned, in a fixed order (MLA layers ascending,
then per KDA layer ``S`` then conv). Bytes are exact: ``S`` stays fp32 and latents keep their dtype, because a
downcast state breaks bit-exact resume (overview §7.3 rule 2). For a DSA model (``schema.dsa``) each MLA
layer's segment is ``[rows, row_bytes]`` uint8 records ``[latent | indexer key]`` and the header's ``mla``
section gains an ``indexer`` entry (dim, storage dtype, fp8 scale dtype, row bytes); dense units are
unchanged, byte for byte.

The header's last field is an xxh3-64 checksum over the whole unit except those 8 bytes, so a flipped bit
anywhere (magic, header, padding, payload) is caught. A decoder rebuilds the header it would have written from
the reader's ``CacheSchema`` and checks it field by field, then byte for byte, before it touches a tensor;
anything off raises a ``CacheUnitError`` subclass, which callers count as a miss.

The shared layout (header, segments, checksum, validation) is in ``unit_format``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvpool.cache.hashing import canonical_tokens
from kvpool.cache.unit_format import (
    KIND_KDA,
    KIND_MLA,
    KIND_TAIL,
    Buffer,
    expect_equal,
    kda_from,
    kda_tensors,
    mla_tensors,
    open_unit,
    plan_unit,
    unit_parts,
    unit_tensors,
    write_unit,
)
from kvpool.model.cache_schema import CacheSchema
from kvpool.model.state import KDACheckpoint


@dataclass
class MLABlock:
    """MLA latents of block ``block_index`` (tokens ``[i·B, (i+1)·B)``) for every MLA layer."""

    block_index: int
    latents: dict[int, torch.Tensor]  # layer id -> [block_size, latent_dim]
    block_hash: bytes | None = None  # the hash closing the block, when the writer recorded it


@dataclass
class RequestTail:
    """What a request leaves after its last full block: the partial block's latents and tokens, and the KDA
    state at the prompt end. Request-scoped (keyed by request id), so it carries its tokens to be verified."""

    start: int  # position of tokens[0]; a multiple of block_size
    tokens: list[int]  # fewer than block_size ids
    mla: dict[int, torch.Tensor]  # layer id -> [len(tokens), latent_dim]
    kda: KDACheckpoint  # n_tokens == start + len(tokens)

    @property
    def n_tokens(self) -> int:
        return self.start + len(self.tokens)


# ------------------------------------------------------------------------------------------------ encoding


def mla_block_unit_size(schema: CacheSchema, block_index: int, *, block_hash: bytes | None = None) -> int:
    """Exact encoded size of an MLA block unit (to size a store allocation or an ``out`` buffer)."""
    return plan_unit(schema, KIND_MLA, block=block_index, block_hash=block_hash).total


def kda_checkpoint_unit_size(schema: CacheSchema, n_tokens: int, *, block_hash: bytes | None = None) -> int:
    """Exact encoded size of a KDA checkpoint unit at ``n_tokens``."""
    return plan_unit(schema, KIND_KDA, n_tokens=n_tokens, block_hash=block_hash).total


def tail_unit_size(schema: CacheSchema, start: int, tokens: list[int]) -> int:
    """Exact encoded size of a request tail unit."""
    return plan_unit(schema, KIND_TAIL, start=start, tokens=canonical_tokens(tokens)).total


def encode_mla_block(
    schema: CacheSchema,
    block_index: int,
    latents: dict[int, torch.Tensor],
    *,
    block_hash: bytes | None = None,
    out: Buffer | None = None,
) -> bytearray | memoryview:
    """Encode one full block of latents for every MLA layer. Returns a new bytearray, or the written
    prefix of ``out`` (no intermediate copy). ``SchemaMismatchError`` if tensors do not fit the schema."""
    plan = plan_unit(schema, KIND_MLA, block=block_index, block_hash=block_hash)
    return write_unit(plan, mla_tensors(plan, schema, latents), out)


def encode_kda_checkpoint(
    schema: CacheSchema,
    checkpoint: KDACheckpoint,
    *,
    block_hash: bytes | None = None,
    out: Buffer | None = None,
) -> bytearray | memoryview:
    """Encode a KDA checkpoint taken at the end of a block (``n_tokens``: a positive multiple of B)."""
    plan = plan_unit(schema, KIND_KDA, n_tokens=checkpoint.n_tokens, block_hash=block_hash)
    return write_unit(plan, kda_tensors(plan, schema, checkpoint), out)


def mla_block_parts(
    schema: CacheSchema,
    block_index: int,
    latents: dict[int, torch.Tensor],
    *,
    block_hash: bytes | None = None,
) -> list[bytes | bytearray | memoryview]:
    """``encode_mla_block`` as parts that view the latents (``unit_parts``): a put with no assembly copy."""
    plan = plan_unit(schema, KIND_MLA, block=block_index, block_hash=block_hash)
    return unit_parts(plan, mla_tensors(plan, schema, latents))


def kda_checkpoint_parts(
    schema: CacheSchema, checkpoint: KDACheckpoint, *, block_hash: bytes | None = None
) -> list[bytes | bytearray | memoryview]:
    """``encode_kda_checkpoint`` as parts that view the state tensors (``unit_parts``)."""
    plan = plan_unit(schema, KIND_KDA, n_tokens=checkpoint.n_tokens, block_hash=block_hash)
    return unit_parts(plan, kda_tensors(plan, schema, checkpoint))


def encode_tail(
    schema: CacheSchema, tail: RequestTail, *, out: Buffer | None = None
) -> bytearray | memoryview:
    """Encode a request tail: partial-block latents + its tokens + the KDA state at its end."""
    tokens = canonical_tokens(tail.tokens)
    plan = plan_unit(schema, KIND_TAIL, start=tail.start, tokens=tokens)
    if tail.kda.n_tokens != plan.header["n_tokens"]:
        raise ValueError(f"tail checkpoint is at {tail.kda.n_tokens}, tail ends at {plan.header['n_tokens']}")
    tensors = mla_tensors(plan, schema, tail.mla) + kda_tensors(plan, schema, tail.kda)
    return write_unit(plan, tensors, out)


# ------------------------------------------------------------------------------------------------ decoding


def decode_mla_block(
    buf: Buffer,
    schema: CacheSchema,
    *,
    expected_block: int | None = None,
    expected_hash: bytes | None = None,
    copy: bool = True,
) -> MLABlock:
    """Decode and fully verify an MLA block unit.

    ``copy=False`` returns views over ``buf`` (zero-copy): only safe while ``buf`` is not reused, and the
    tensors must not be written when ``buf`` is read-only. ``expected_hash`` also rejects units written
    without a hash.
    """
    mv, plan = open_unit(buf, schema, KIND_MLA)
    expect_equal("block index", plan.header["block"], expected_block)
    expect_equal("block hash", plan.header["hash"], None if expected_hash is None else bytes(expected_hash))
    tensors = unit_tensors(mv, plan, copy)
    latents = dict(zip(schema.mla_layers, tensors, strict=True))
    return MLABlock(plan.header["block"], latents, plan.header["hash"])


def decode_kda_checkpoint(
    buf: Buffer,
    schema: CacheSchema,
    *,
    expected_n_tokens: int | None = None,
    expected_hash: bytes | None = None,
    copy: bool = True,
) -> KDACheckpoint:
    """Decode and fully verify a KDA checkpoint unit (see ``decode_mla_block`` for ``copy``)."""
    mv, plan = open_unit(buf, schema, KIND_KDA)
    expect_equal("checkpoint n_tokens", plan.header["n_tokens"], expected_n_tokens)
    expect_equal("block hash", plan.header["hash"], None if expected_hash is None else bytes(expected_hash))
    return kda_from(schema, plan.header["n_tokens"], unit_tensors(mv, plan, copy))


def decode_tail(
    buf: Buffer,
    schema: CacheSchema,
    *,
    expected_start: int | None = None,
    expected_tokens: list[int] | None = None,
    copy: bool = True,
) -> RequestTail:
    """Decode and fully verify a request tail; ``expected_tokens`` guards against a tail of another prompt."""
    mv, plan = open_unit(buf, schema, KIND_TAIL)
    expect_equal("tail start", plan.header["start"], expected_start)
    if expected_tokens is not None:
        expect_equal("tail tokens", plan.header["tokens"], canonical_tokens(expected_tokens))
    tensors = unit_tensors(mv, plan, copy)
    n_mla = len(schema.mla_layers)
    return RequestTail(
        start=plan.header["start"],
        tokens=list(plan.header["tokens"]),
        mla=dict(zip(schema.mla_layers, tensors[:n_mla], strict=True)),
        kda=kda_from(schema, plan.header["n_tokens"], tensors[n_mla:]),
    )
