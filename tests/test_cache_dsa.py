"""Cache units of a DSA model: MLA rows carry indexer keys (bf16, or fp8 e4m3 + fp32 scale) as byte records
``[latent | key]``. Round trips are bitwise, the header and the schema sizes say so, a DSA unit and a dense
unit are never read by the other's schema, dense units are byte-identical to format v1's, and a resume
from decoded units equals the uncut run bit for bit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import xxhash
from kvpool.cache.errors import SchemaMismatchError
from kvpool.cache.units import (
    RequestTail,
    decode_kda_checkpoint,
    decode_mla_block,
    decode_tail,
    encode_kda_checkpoint,
    encode_mla_block,
    encode_tail,
    mla_block_unit_size,
)
from kvpool.model.cache_schema import CacheSchema, index_key_record_bytes
from kvpool.model.loader import load_model
from kvpool.model.state import KDACheckpoint, KDALayerState, PrefixState

pytestmark = pytest.mark.usefixtures("torch_deterministic")
FP = bytes(range(32))


def dense_schema(**kw: object) -> CacheSchema:
    base = dict(
        fingerprint=FP,
        mla_layers=(3,),
        latent_dim=80,
        mla_dtype="float32",
        kda_layers=(0, 1, 2),
        state_shape=(4, 32, 32),
        conv_shape=(3, 384),
        conv_dtype="float32",
        block_size=64,
    )
    return CacheSchema(**{**base, **kw})


@pytest.fixture(scope="module", params=["float8_e4m3fn", "bfloat16"])
def run(request):
    """A tiny-dsa prefill of 2 blocks + a 20-token tail: real latent + indexer rows and KDA states."""
    model = load_model("tiny-dsa" if request.param == "bfloat16" else "tiny-dsa-fp8")
    ids = torch.randint(3, 1024, (148,), generator=torch.Generator().manual_seed(0)).tolist()
    return model, ids, model.prefill(ids, boundaries=(64, 128))


def test_schema_sizes_and_header(run):
    model, _, r = run
    s = model.cache_schema(64)
    key = {"bfloat16": 64, "float8_e4m3fn": 36}[s.index_dtype]
    assert s.dsa and s.index_dim == 32 and s.mla_row_bytes == 80 * 4 + key
    assert s.mla_block_bytes() == 64 * (320 + key) and r.mla[3].shape == (148, 320 + key)
    unit = encode_mla_block(s, 0, {3: r.mla[3][:64]})
    assert len(unit) == mla_block_unit_size(s, 0)
    header = bytes(unit[8 : 8 + int.from_bytes(unit[4:8], "little")])
    assert b"indexer" in header and s.index_dtype.encode() in header


def test_k31_sizes():
    """K3.1 as specified: 24 MLA layers x (576 bf16 latent values + 128 fp8 key + fp32 scale) = 1284 B."""
    s = dense_schema(
        mla_layers=tuple(range(24)),
        latent_dim=576,
        mla_dtype="bfloat16",
        index_dim=128,
        index_dtype="float8_e4m3fn",
    )
    assert (
        index_key_record_bytes(128, "float8_e4m3fn") == 132 and index_key_record_bytes(128, "bfloat16") == 256
    )
    assert s.mla_row_bytes == 1152 + 132
    assert s.mla_block_bytes(512) == 512 * 24 * 1284
    assert (
        dense_schema(mla_layers=tuple(range(24)), latent_dim=576, mla_dtype="bfloat16").mla_row_bytes == 1152
    )


@pytest.mark.parametrize("copy", [True, False])
def test_units_round_trip_indexer_keys_bitwise(run, copy):
    model, ids, r = run
    s = model.cache_schema(64)
    blk = decode_mla_block(
        bytes(encode_mla_block(s, 1, {3: r.mla[3][64:128]})), s, expected_block=1, copy=copy
    )
    assert torch.equal(blk.latents[3], r.mla[3][64:128])
    tail = RequestTail(128, ids[128:], {3: r.mla[3][128:]}, r.final)
    back = decode_tail(bytes(encode_tail(s, tail)), s, expected_tokens=ids[128:], copy=copy)
    assert torch.equal(back.mla[3], r.mla[3][128:])
    fmt = model.model.layers[3].self_attn.row_format()
    assert torch.equal(fmt.keys(back.mla[3]), fmt.keys(r.mla[3][128:]))  # the dequantised keys too


def test_dense_and_dsa_units_are_not_interchangeable(run):
    model, _, r = run
    dsa = replace(model.cache_schema(64), fingerprint=FP)  # same fingerprint: only the layout differs
    dense = replace(dsa, index_dim=0, index_dtype="")
    other = replace(dsa, index_dtype="bfloat16" if dsa.index_dtype != "bfloat16" else "float8_e4m3fn")
    unit = bytes(encode_mla_block(dsa, 0, {3: r.mla[3][:64]}))
    for wrong in (dense, other):
        with pytest.raises(SchemaMismatchError, match="indexer"):
            decode_mla_block(unit, wrong)
    dense_unit = bytes(encode_mla_block(dense, 0, {3: torch.zeros(64, 80)}))
    with pytest.raises(SchemaMismatchError, match="indexer"):
        decode_mla_block(dense_unit, dsa)
    with pytest.raises(SchemaMismatchError):  # dense latents offered to a DSA schema
        encode_mla_block(dsa, 0, {3: torch.zeros(64, 80)})
    tail = RequestTail(128, [5] * 20, {3: r.mla[3][128:]}, r.final)
    with pytest.raises(SchemaMismatchError, match="indexer"):
        decode_tail(bytes(encode_tail(dsa, tail)), dense)


def test_dense_units_are_byte_identical_to_format_v1():
    """Digests of units written by the codec before DSA existed (same inputs): dense units did not change."""
    s = dense_schema()
    g = torch.Generator().manual_seed(7)
    lat = {3: torch.randn(64, 80, generator=g)}
    ck = KDACheckpoint(
        64,
        {
            i: KDALayerState(torch.randn(4, 32, 32, generator=g), torch.randn(3, 384, generator=g))
            for i in (0, 1, 2)
        },
    )
    tail = RequestTail(64, [5, 6, 7], {3: torch.randn(3, 80, generator=g)}, KDACheckpoint(67, ck.layers))
    units = (
        bytes(encode_mla_block(s, 1, lat, block_hash=bytes(32))),
        bytes(encode_kda_checkpoint(s, ck)),
        bytes(encode_tail(s, tail)),
    )
    got = [xxhash.xxh3_64_hexdigest(u) for u in units]
    assert got == ["f0597039ec517a6e", "682e1200b0adbf38", "6b426b36850e16f9"]
    assert torch.equal(decode_mla_block(units[0], s).latents[3], lat[3])


def test_resume_from_decoded_units_is_bitwise(run):
    """prefill -> units (blocks 0..1, checkpoint at 128) -> bytes -> decode -> resume == the uncut run."""
    model, ids, r = run
    s = model.cache_schema(64)
    blocks = [bytes(encode_mla_block(s, i, {3: r.mla[3][64 * i : 64 * (i + 1)]})) for i in range(2)]
    ckpt = bytes(encode_kda_checkpoint(s, r.checkpoints[128]))
    rows = torch.cat([decode_mla_block(b, s, expected_block=i).latents[3] for i, b in enumerate(blocks)])
    start = PrefixState(128, decode_kda_checkpoint(ckpt, s, expected_n_tokens=128), {3: rows})
    rest = model.prefill(ids[128:], start=start)
    assert torch.equal(rest.logits, r.logits) and torch.equal(rest.mla[3], r.mla[3])
