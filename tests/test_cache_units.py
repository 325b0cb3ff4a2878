"""Cache-unit codec: bitwise round trips; every kind of bad input is a typed miss, never a wrong tensor."""

from __future__ import annotations

import dataclasses
import random
import struct

import msgpack
import pytest
import torch
import xxhash
from kvpool.cache import unit_format
from kvpool.cache.errors import (
    CacheUnitError,
    CorruptUnitError,
    FingerprintMismatchError,
    PositionMismatchError,
    SchemaMismatchError,
    UnsupportedVersionError,
)
from kvpool.cache.hashing import hash_blocks, root_hash, usable_tokens
from kvpool.cache.units import (
    MLABlock,
    RequestTail,
    decode_kda_checkpoint,
    decode_mla_block,
    decode_tail,
    encode_kda_checkpoint,
    encode_mla_block,
    encode_tail,
    kda_checkpoint_parts,
    kda_checkpoint_unit_size,
    mla_block_parts,
    mla_block_unit_size,
    tail_unit_size,
)
from kvpool.model.cache_schema import CacheSchema
from kvpool.model.state import KDACheckpoint, KDALayerState

FP = bytes(range(32))


def tiny_schema(mla_dtype: str = "bfloat16", conv_dtype: str = "bfloat16") -> CacheSchema:
    """overview §7.4 tiny8-like: 6 KDA + 2 MLA layers, latent 80, H=4, dk=dv=32, conv 3 x 384."""
    return CacheSchema(
        fingerprint=FP,
        mla_layers=(3, 7),
        latent_dim=80,
        mla_dtype=mla_dtype,
        kda_layers=(0, 1, 2, 4, 5, 6),
        state_shape=(4, 32, 32),
        conv_shape=(3, 384),
        conv_dtype=conv_dtype,
        block_size=64,
    )


def rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values plus the awkward ones a bit-exact codec must keep: -0.0, inf, NaN, subnormals."""
    t = torch.randn(shape, generator=gen).to(dtype)
    flat = t.view(-1)
    if flat.numel() >= 5:
        flat[:5] = torch.tensor([-0.0, float("inf"), float("nan"), 1e-40, -3.0e38]).to(dtype)
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view: torch.equal on it is a bitwise comparison (NaN == NaN, -0.0 != 0.0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def make_latents(s: CacheSchema, rows: int, seed: int) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {lid: rand((rows, s.latent_dim), getattr(torch, s.mla_dtype), gen) for lid in s.mla_layers}


def make_ckpt(s: CacheSchema, n_tokens: int, seed: int) -> KDACheckpoint:
    gen = torch.Generator().manual_seed(seed)
    layers = {
        lid: KDALayerState(
            recurrent=rand(s.state_shape, torch.float32, gen),
            conv=rand(s.conv_shape, getattr(torch, s.conv_dtype), gen),
        )
        for lid in s.kda_layers
    }
    return KDACheckpoint(n_tokens=n_tokens, layers=layers)


def make_tail(s: CacheSchema, start: int = 128, n: int = 37, seed: int = 0) -> RequestTail:
    tokens = [random.Random(seed).randrange(50_000) for _ in range(n)]
    return RequestTail(start, tokens, make_latents(s, n, seed), make_ckpt(s, start + n, seed + 1))


def assert_ckpt_equal(a: KDACheckpoint, b: KDACheckpoint) -> None:
    assert a.n_tokens == b.n_tokens and sorted(a.layers) == sorted(b.layers)
    for lid in a.layers:
        assert same(a.layers[lid].recurrent, b.layers[lid].recurrent)
        assert same(a.layers[lid].conv, b.layers[lid].conv)


def reforge(unit: bytes, **changes: object) -> bytes:
    """Rewrite header fields and re-seal the unit with a valid checksum: a buggy or future writer's output."""
    (hlen,) = struct.unpack_from("<I", unit, 4)
    header = msgpack.unpackb(unit[8 : 8 + hlen], raw=False)
    payload = unit[-header["plen"] :] if header["plen"] else b""
    header.update(changes)
    header.pop("csum")
    header["csum"] = bytes(8)
    hb = msgpack.packb(header, use_bin_type=True)
    pad = -(8 + len(hb)) % 64
    body = bytearray(b"KVPU" + struct.pack("<I", len(hb)) + hb + bytes(pad) + payload)
    end = 8 + len(hb)
    h = xxhash.xxh3_64()
    h.update(bytes(body[: end - 8]))
    h.update(bytes(body[end:]))
    body[end - 8 : end] = h.digest()
    return bytes(body)


# ------------------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("mla_dtype", ["bfloat16", "float32", "float16"])
@pytest.mark.parametrize("copy", [True, False])
def test_mla_block_round_trip(mla_dtype: str, copy: bool) -> None:
    s = tiny_schema(mla_dtype=mla_dtype)
    lat = make_latents(s, 64, seed=1)
    h = bytes(range(100, 132))
    unit = encode_mla_block(s, 9, lat, block_hash=h)
    assert len(unit) == mla_block_unit_size(s, 9, block_hash=h)
    for buf in (bytes(unit), unit, memoryview(unit)):
        got = decode_mla_block(buf, s, expected_block=9, expected_hash=h, copy=copy)
        assert isinstance(got, MLABlock) and got.block_index == 9 and got.block_hash == h
        assert sorted(got.latents) == [3, 7]
        assert all(same(got.latents[lid], lat[lid]) for lid in s.mla_layers)


@pytest.mark.parametrize("conv_dtype", ["bfloat16", "float32"])
def test_kda_checkpoint_round_trip_keeps_fp32_state(conv_dtype: str) -> None:
    s = tiny_schema(conv_dtype=conv_dtype)
    ck = make_ckpt(s, 192, seed=2)
    unit = encode_kda_checkpoint(s, ck)
    assert len(unit) == kda_checkpoint_unit_size(s, 192)
    got = decode_kda_checkpoint(unit, s, expected_n_tokens=192)
    assert_ckpt_equal(got, ck)
    assert all(st.recurrent.dtype == torch.float32 for st in got.layers.values())
    assert len(unit) - s.kda_checkpoint_bytes() < 1024  # exact bytes, no inflation beyond header + alignment


@pytest.mark.parametrize("n", [0, 1, 37, 63])
def test_tail_round_trip(n: int) -> None:
    s = tiny_schema()
    tail = make_tail(s, start=128, n=n, seed=n)
    unit = encode_tail(s, tail)
    assert len(unit) == tail_unit_size(s, 128, tail.tokens)
    got = decode_tail(unit, s, expected_start=128, expected_tokens=tail.tokens)
    assert got.start == 128 and got.tokens == tail.tokens and got.n_tokens == 128 + n
    assert all(same(got.mla[lid], tail.mla[lid]) for lid in s.mla_layers)
    assert_ckpt_equal(got.kda, tail.kda)


def test_encoding_is_deterministic_and_writes_into_caller_buffer() -> None:
    s = tiny_schema()
    tail = make_tail(s)
    fresh = bytes(encode_tail(s, tail))
    assert bytes(encode_tail(s, tail)) == fresh
    arena = bytearray(b"\xa5" * (1000 + len(fresh) + 4096))  # dirty buffer: padding must still come out zero
    view = encode_tail(s, tail, out=memoryview(arena)[1000:])
    assert bytes(view) == fresh and arena[:1000] == b"\xa5" * 1000
    assert arena[1000 + len(fresh) :] == b"\xa5" * 4096  # nothing written past the unit
    with pytest.raises(ValueError):
        encode_tail(s, tail, out=bytearray(len(fresh) - 1))
    with pytest.raises(ValueError):
        encode_tail(s, tail, out=bytes(len(fresh)))


@pytest.mark.parametrize("mla_dtype", ["bfloat16", "float32"])
def test_unit_parts_concatenate_to_the_encoded_unit_byte_for_byte(mla_dtype: str) -> None:
    """The parts a put sends without assembling them (header, zero padding, tensor views) are exactly the
    unit ``encode_*`` writes, checksum included, and the tensors are viewed, not copied."""
    s = tiny_schema(mla_dtype=mla_dtype)
    lat = make_latents(s, 64, seed=3)
    h = bytes(range(7, 39))
    parts = mla_block_parts(s, 5, lat, block_hash=h)
    assert b"".join(bytes(p) for p in parts) == bytes(encode_mla_block(s, 5, lat, block_hash=h))
    views = [p for p in parts if isinstance(p, memoryview)]
    assert len(views) == len(s.mla_layers)
    first = lat[s.mla_layers[0]].view(-1)
    first[0] += 1  # a view of the tensor sees the change: no copy was made
    size = first.element_size()
    assert bytes(views[0][:size]) == first[:1].view(torch.uint8).numpy().tobytes()
    ck = make_ckpt(s, 128, seed=4)
    joined = b"".join(bytes(p) for p in kda_checkpoint_parts(s, ck, block_hash=h))
    assert joined == bytes(encode_kda_checkpoint(s, ck, block_hash=h))
    assert_ckpt_equal(decode_kda_checkpoint(joined, s, expected_n_tokens=128, expected_hash=h), ck)


def test_zero_copy_views_are_aligned_and_copies_are_independent() -> None:
    s = tiny_schema()
    ck = make_ckpt(s, 64, seed=3)
    buf = bytearray(encode_kda_checkpoint(s, ck))
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    views = decode_kda_checkpoint(buf, s, copy=False)
    copies = decode_kda_checkpoint(buf, s, copy=True)
    for st in views.layers.values():
        assert (st.recurrent.data_ptr() - base) % 64 == 0 and (st.conv.data_ptr() - base) % 64 == 0
    first = s.kda_layers[0]
    buf[-1] ^= 0xFF  # reuse the buffer: a view sees it, a copy must not
    buf[len(buf) - s.kda_checkpoint_bytes()] ^= 0xFF
    assert not same(views.layers[first].recurrent, ck.layers[first].recurrent)
    assert_ckpt_equal(copies, ck)


def test_block_keyed_units_carry_the_hash_that_closes_them() -> None:
    s = tiny_schema()
    hashes = hash_blocks(list(range(64 * 3)), 64, root_hash(FP, "t"))
    for i, h in enumerate(hashes):
        unit = encode_kda_checkpoint(s, make_ckpt(s, usable_tokens(i + 1, 64), i), block_hash=h)
        got = decode_kda_checkpoint(unit, s, expected_n_tokens=(i + 1) * 64, expected_hash=h)
        assert got.n_tokens == 64 * (i + 1)
        mla = encode_mla_block(s, i, make_latents(s, 64, i), block_hash=h)
        assert decode_mla_block(mla, s, expected_block=i, expected_hash=h).block_hash == h
        with pytest.raises(PositionMismatchError):
            decode_mla_block(mla, s, expected_hash=hashes[i - 1])


def test_k3_scale_sizes_without_allocating() -> None:
    """overview §7.5: 69 KDA layers x 6,512,640 B; 24 MLA layers x 1152 B per token (bf16)."""
    k3 = CacheSchema(
        fingerprint=FP,
        mla_layers=(*range(3, 92, 4), 92),  # 1-based 4, 8, ..., 92, 93
        latent_dim=576,
        mla_dtype="bfloat16",
        kda_layers=tuple(i for i in range(92) if i % 4 != 3),
        state_shape=(96, 128, 128),
        conv_shape=(3, 3 * 96 * 128),
        conv_dtype="bfloat16",
        block_size=512,
    )
    assert len(k3.mla_layers) == 24 and k3.kda_checkpoint_bytes() == 449_372_160
    assert 0 < kda_checkpoint_unit_size(k3, 8192) - 449_372_160 < 2048
    assert 0 < mla_block_unit_size(k3, 15) - 24 * 512 * 1152 < 1024
    assert 0 < tail_unit_size(k3, 8192, list(range(100))) - 449_372_160 - 24 * 100 * 1152 < 4096


# ------------------------------------------------------------------------------------------------ bad input


@pytest.fixture(scope="module")
def tail_unit() -> bytes:
    return bytes(encode_tail(tiny_schema(), make_tail(tiny_schema())))


def test_error_hierarchy() -> None:
    for cls in (
        CorruptUnitError,
        FingerprintMismatchError,
        SchemaMismatchError,
        UnsupportedVersionError,
        PositionMismatchError,
    ):
        assert issubclass(cls, CacheUnitError)


def test_any_flipped_byte_is_a_miss(tail_unit: bytes) -> None:
    s = tiny_schema()
    (hlen,) = struct.unpack_from("<I", tail_unit, 4)
    rng = random.Random(0)
    positions = [*range(8 + hlen + 64), *rng.sample(range(8 + hlen, len(tail_unit)), 300), len(tail_unit) - 1]
    for pos in positions:
        bad = bytearray(tail_unit)
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(CacheUnitError) as info:
            decode_tail(bad, s)
        if pos >= 8 + hlen or pos < 4:  # padding, payload, magic: only the checksum / magic can notice
            assert type(info.value) is CorruptUnitError, pos
        else:  # header bytes: unparsable, bad checksum, or (a flipped version) unsupported
            assert type(info.value) in (CorruptUnitError, UnsupportedVersionError), pos


def test_truncated_or_padded_is_corrupt(tail_unit: bytes) -> None:
    s = tiny_schema()
    for n in [0, 3, 7, 8, 9, 40, *range(len(tail_unit) - 70, len(tail_unit))]:
        with pytest.raises(CorruptUnitError):
            decode_tail(tail_unit[:n], s)
    with pytest.raises(CorruptUnitError):
        decode_tail(tail_unit + b"\x00", s)


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"KVPU",
        b"\x00" * 4096,
        bytes(random.Random(1).randrange(256) for _ in range(4096)),
        b"KVPU" + struct.pack("<I", 2**31) + b"\x00" * 64,
        b"KVPU" + struct.pack("<I", 3) + b"\x93\x01\x02",
        b"KVPU" + struct.pack("<I", 20) + b"\xc1" * 20,
    ],
)
def test_garbage_is_corrupt(garbage: bytes) -> None:
    for decode in (decode_tail, decode_mla_block, decode_kda_checkpoint):
        with pytest.raises(CorruptUnitError):
            decode(garbage, tiny_schema())
    with pytest.raises(CorruptUnitError):
        decode_tail(12345, tiny_schema())  # type: ignore[arg-type]


def test_unknown_version(tail_unit: bytes) -> None:
    for v in (0, 2, 999):
        with pytest.raises(UnsupportedVersionError):
            decode_tail(reforge(tail_unit, v=v), tiny_schema())
    decode_tail(reforge(tail_unit), tiny_schema())  # the forger itself produces valid units


def test_wrong_fingerprint(tail_unit: bytes) -> None:
    other = dataclasses.replace(tiny_schema(), fingerprint=bytes(32))
    with pytest.raises(FingerprintMismatchError):
        decode_tail(tail_unit, other)


@pytest.mark.parametrize(
    "change",
    [
        {"latent_dim": 96},
        {"mla_dtype": "float32"},
        {"mla_layers": (3,)},
        {"mla_layers": (3, 11)},
        {"kda_layers": (0, 1, 2, 4, 5)},
        {"state_shape": (4, 32, 64)},
        {"state_layout": "HVK"},
        {"conv_shape": (4, 384)},
        {"conv_shape": (3, 192)},
        {"conv_dtype": "float32"},
        {"block_size": 128},
    ],
)
def test_schema_mismatch(tail_unit: bytes, change: dict[str, object]) -> None:
    with pytest.raises(SchemaMismatchError):
        decode_tail(tail_unit, dataclasses.replace(tiny_schema(), **change))


def test_wrong_kind_is_schema_mismatch(tail_unit: bytes) -> None:
    s = tiny_schema()
    with pytest.raises(SchemaMismatchError):
        decode_mla_block(tail_unit, s)
    with pytest.raises(SchemaMismatchError):
        decode_kda_checkpoint(encode_mla_block(s, 0, make_latents(s, 64, 0)), s)


def test_position_mismatch(tail_unit: bytes) -> None:
    s = tiny_schema()
    tail = make_tail(s)
    with pytest.raises(PositionMismatchError):
        decode_tail(tail_unit, s, expected_start=64)
    with pytest.raises(PositionMismatchError):
        decode_tail(tail_unit, s, expected_tokens=[*tail.tokens[:-1], tail.tokens[-1] + 1])
    mla = encode_mla_block(s, 4, make_latents(s, 64, 0))
    with pytest.raises(PositionMismatchError):
        decode_mla_block(mla, s, expected_block=5)
    with pytest.raises(PositionMismatchError):
        decode_mla_block(mla, s, expected_hash=bytes(32))  # written without a hash
    ck = encode_kda_checkpoint(s, make_ckpt(s, 128, 0))
    with pytest.raises(PositionMismatchError):
        decode_kda_checkpoint(ck, s, expected_n_tokens=192)


@pytest.mark.parametrize(
    "fields",
    [
        {"n_tokens": 999},  # inconsistent with start + len(tokens)
        {"start": 100},  # not block aligned
        {"tokens": list(range(70))},  # longer than a block
        {"tokens": [-1] * 37},
        {"plen": 12},
        {"start": True},
        {"hash": b"short"},
        {"mla": None},
        {"kda": "x"},
        {"fp": "not bytes"},
        {"extra_field": 1},
    ],
)
def test_sealed_but_inconsistent_header_is_a_miss(tail_unit: bytes, fields: dict[str, object]) -> None:
    """A checksum only proves the bytes are what the writer wrote; a buggy writer is still caught."""
    with pytest.raises(CacheUnitError):
        decode_tail(reforge(tail_unit, **fields), tiny_schema())


def test_encode_rejects_tensors_that_do_not_fit_the_schema() -> None:
    s = tiny_schema()
    lat = make_latents(s, 64, 0)
    for bad in (
        {3: lat[3]},
        {**lat, 11: lat[3]},
        {**lat, 7: lat[7].float()},
        {**lat, 7: lat[7][:63]},
        {**lat, 7: "x"},
    ):
        with pytest.raises(SchemaMismatchError):
            encode_mla_block(s, 0, bad)  # type: ignore[arg-type]
    ck = make_ckpt(s, 64, 0)
    ck.layers[0].recurrent = ck.layers[0].recurrent.bfloat16()  # a downcast state is refused, not stored
    with pytest.raises(SchemaMismatchError):
        encode_kda_checkpoint(s, ck)
    with pytest.raises(SchemaMismatchError):
        encode_kda_checkpoint(s, KDACheckpoint(64, {}))
    for n in (0, 65):
        with pytest.raises(ValueError):
            encode_kda_checkpoint(s, make_ckpt(s, n, 0))
    tail = make_tail(s)
    with pytest.raises(ValueError):
        encode_tail(s, dataclasses.replace(tail, kda=make_ckpt(s, 128, 0)))
    with pytest.raises(ValueError):
        encode_tail(s, dataclasses.replace(tail, start=100))
    with pytest.raises(ValueError):
        encode_mla_block(s, -1, lat)


def test_units_module_constants() -> None:
    assert unit_format.MAGIC == b"KVPU" and unit_format.ALIGN == 64
