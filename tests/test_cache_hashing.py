"""Block hash chain: stable across processes, pinned to a golden value, isolating tenants and models."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from kvpool.cache.errors import HashInputError
from kvpool.cache.hashing import (
    BlockHasher,
    check_block_size,
    hash_block,
    hash_blocks,
    root_hash,
    usable_tokens,
)
from kvpool.kvstore.keys import kda_key, mla_key
from kvpool.model.cache_schema import FORMAT_VERSION

FP = bytes(range(32))
TOKENS = list(range(1000, 1000 + 300))  # 4 full blocks of 64 + a 44-token tail

# Pinned: if any of these change, every stored object and every trace-derived index becomes unreachable.
GOLDEN_ROOT = "9fdc5e2457b70553d313f06681391cd0085b64084c509ab6c67e367373390fd5"
GOLDEN_CHAIN_PREFIXES = ["ccaad02fedb88f7e", "d648b539cd891dad", "8696e45de27b9915", "215d88114d56523f"]
GOLDEN_CHAIN_SCRIPT = """
import json, sys
from kvpool.cache.hashing import hash_blocks, root_hash
root = root_hash(bytes(range(32)), "tenant-a")
extra = frozenset({"img-1", "img-2", "img-3", "x", "y"})  # set order depends on PYTHONHASHSEED
print(json.dumps([h.hex() for h in hash_blocks(list(range(1000, 1300)), 64, root, extra)]))
"""


def _manual_root(fp: bytes, salt: str) -> bytes:
    """CBOR by hand (RFC 8949): array(3), uint version, bstr(32), tstr — proves the encoding without cbor2."""
    assert FORMAT_VERSION < 24 and len(salt) < 24
    enc = b"\x83" + bytes([FORMAT_VERSION]) + b"\x58\x20" + fp + bytes([0x60 + len(salt)]) + salt.encode()
    return hashlib.sha256(enc).digest()


def _cbor_uint(n: int) -> bytes:
    if n < 24:
        return bytes([n])
    if n < 256:
        return b"\x18" + bytes([n])
    return b"\x19" + n.to_bytes(2, "big")


def test_root_matches_hand_encoded_cbor() -> None:
    assert root_hash(FP) == _manual_root(FP, "")
    assert root_hash(FP, "tenant-a") == _manual_root(FP, "tenant-a")


def test_block_matches_hand_encoded_cbor() -> None:
    root = root_hash(FP)
    block = TOKENS[:64]
    enc = b"\x83" + b"\x58\x20" + root + b"\x98\x40" + b"".join(_cbor_uint(t) for t in block) + b"\xf6"
    assert hash_blocks(TOKENS, 64, root)[0] == hashlib.sha256(enc).digest()


def test_golden_values() -> None:
    root = root_hash(FP)
    assert root.hex() == GOLDEN_ROOT
    assert [h.hex()[:16] for h in hash_blocks(TOKENS, 64, root)] == GOLDEN_CHAIN_PREFIXES


def test_identical_across_processes_and_hash_seeds() -> None:
    outs = set()
    for seed in ("0", "1", "random", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run(
            [sys.executable, "-c", GOLDEN_CHAIN_SCRIPT], env=env, capture_output=True, text=True, check=True
        )
        outs.add(res.stdout.strip())
    assert len(outs) == 1
    root = root_hash(FP, "tenant-a")
    extra = frozenset({"img-1", "img-2", "img-3", "x", "y"})
    local = [h.hex() for h in hash_blocks(TOKENS, 64, root, extra)]
    assert outs.pop() == str(local).replace("'", '"')


def test_full_blocks_only_and_prefix_property() -> None:
    root = root_hash(FP)
    hashes = hash_blocks(TOKENS, 64, root)
    assert len(hashes) == 4 and all(len(h) == 32 for h in hashes)
    assert len(set(hashes)) == 4
    assert hash_blocks(TOKENS[:63], 64, root) == []
    for k in range(5):
        assert hash_blocks(TOKENS[: k * 64], 64, root) == hashes[:k]
        assert hash_blocks(TOKENS[: k * 64 + 17], 64, root) == hashes[:k]
    assert hash_blocks(TOKENS[:256], 128, root) != hashes[:2]  # block size is part of what is hashed


def test_disjoint_chains_for_salts_and_fingerprints() -> None:
    chains = [
        hash_blocks(TOKENS, 64, root_hash(FP, "")),
        hash_blocks(TOKENS, 64, root_hash(FP, "tenant-a")),
        hash_blocks(TOKENS, 64, root_hash(FP, "tenant-b")),
        hash_blocks(TOKENS, 64, root_hash(bytes(32), "")),
        hash_blocks(TOKENS, 64, root_hash(bytes(31) + b"\x01", "")),
    ]
    seen: set[bytes] = set()
    for chain in chains:
        assert not seen & set(chain)
        seen |= set(chain)


def test_every_hash_depends_on_all_earlier_tokens() -> None:
    root = root_hash(FP)
    base = hash_blocks(TOKENS, 64, root)
    for pos in (0, 63, 64, 200):
        changed = list(TOKENS)
        changed[pos] += 1
        other = hash_blocks(changed, 64, root)
        first = pos // 64
        assert other[:first] == base[:first]
        assert all(a != b for a, b in zip(other[first:], base[first:], strict=True))


def test_extra_is_hashed() -> None:
    root = root_hash(FP)
    plain = hash_blocks(TOKENS, 64, root)
    assert hash_blocks(TOKENS, 64, root, extra=None) == plain
    with_mm = hash_blocks(TOKENS, 64, root, extra=["img-sha"])
    assert not set(plain) & set(with_mm)
    per_block = hash_block(root, TOKENS[:64], {"mm": [b"\x01"]})
    assert per_block != plain[0] and per_block == hash_block(root, TOKENS[:64], {"mm": [b"\x01"]})


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_incremental_hasher_matches_batch(seed: int) -> None:
    rng = random.Random(seed)
    block = rng.choice([64, 128, 192])
    tokens = [rng.randrange(0, 200_000) for _ in range(rng.randrange(0, 1500))]
    root = root_hash(bytes(rng.randrange(256) for _ in range(32)), f"salt-{seed}")
    hasher = BlockHasher(block, root)
    got = []
    i = 0
    while i < len(tokens):
        step = rng.choice([1, 1, 3, 63, 64, 65, 500])
        closed = hasher.feed(tokens[i : i + step])
        i += step
        assert len(got) + len(closed) == min(i, len(tokens)) // block  # closes exactly at boundaries
        got += closed
    assert got == hash_blocks(tokens, block, root) == hasher.hashes
    assert hasher.n_tokens == len(tokens)
    assert hasher.pending == tokens[len(got) * block :]
    assert hasher.last_hash == (got[-1] if got else root)


def test_object_keyed_by_hash_closing_it() -> None:
    root = root_hash(FP)
    hashes = hash_blocks(TOKENS, 64, root)
    for i, h in enumerate(hashes):
        # the checkpoint after block i sits at (i + 1) * B and is stored under the hash that closes block i
        assert usable_tokens(i + 1, 64) == (i + 1) * 64
        assert kda_key(h) == b"K" + h and mla_key(h) == b"M" + h
        assert hash_blocks(TOKENS[: usable_tokens(i + 1, 64)], 64, root)[-1] == h
    assert usable_tokens(0, 64) == 0


def test_token_types() -> None:
    root = root_hash(FP)
    ref = hash_blocks(TOKENS, 64, root)
    assert hash_blocks(np.array(TOKENS, dtype=np.int64), 64, root) == ref
    assert hash_blocks(torch.tensor(TOKENS), 64, root) == ref
    assert hash_blocks([np.int32(t) for t in TOKENS], 64, root) == ref
    assert hash_blocks(tuple(TOKENS), 64, root) == ref


@pytest.mark.parametrize("bad", [[-1], [True], [1.0], ["3"], [None], [2**64]])
def test_bad_tokens_rejected(bad: list[object]) -> None:
    root = root_hash(FP)
    with pytest.raises(HashInputError):
        hash_blocks(TOKENS[:10] + bad + TOKENS[:60], 64, root)
    hasher = BlockHasher(64, root)
    hasher.feed(TOKENS[:60])
    with pytest.raises(HashInputError):
        hasher.feed(TOKENS[:10] + bad)
    assert hasher.n_tokens == 60  # unchanged by the failed feed


@pytest.mark.parametrize("bad", [0, -64, 32, 100, 64.0, True, "64", None])
def test_bad_block_size_rejected(bad: object) -> None:
    with pytest.raises(HashInputError):
        hash_blocks(TOKENS, bad, root_hash(FP))  # type: ignore[arg-type]
    with pytest.raises(HashInputError):
        usable_tokens(1, bad)  # type: ignore[arg-type]
    assert check_block_size(512) == 512


def test_bad_roots_and_extras_rejected() -> None:
    assert issubclass(HashInputError, ValueError)
    for fp in (b"", bytes(31), bytes(33), "x" * 32):
        with pytest.raises(HashInputError):
            root_hash(fp)  # type: ignore[arg-type]
    with pytest.raises(HashInputError):
        root_hash(FP, salt=b"bytes")  # type: ignore[arg-type]
    with pytest.raises(HashInputError):
        hash_blocks(TOKENS, 64, b"short")
    with pytest.raises(HashInputError):
        BlockHasher(64, root_hash(FP), extra=object())
    with pytest.raises(HashInputError):
        usable_tokens(-1, 64)
