"""Puts of an object held as parts (``Payload``: a cache unit's header, padding and tensor views) through
every transport, single and batched, against a real master + node: what is stored is exactly the
concatenation, under the checksum of the concatenation, with no assembly copy on the client."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
import xxhash
from kvpool.kvstore.client.async_client import AsyncStoreClient, PutItem
from kvpool.kvstore.transport.base import Payload, as_bytes_view
from store_helpers import start_master, start_node

MB = 1 << 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("parts")
    master = start_master(logs)
    node = start_node(logs, master.address, "128MiB")
    yield master, node
    assert node.stop() == 0, node.stderr()
    master.stop()


def _parts(seed: int) -> tuple[Payload, bytes]:
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(3 * 1024 + 5, 80, generator=gen).to(torch.bfloat16)  # ~0.5 MB, bf16 like K3
    big = torch.randn(300_000, generator=gen)  # 1.2 MB fp32, crosses the 256 KB copy and 1 MiB send chunks
    parts = [b"header" + bytes(58), latents, bytes(64), big, os.urandom(777)]
    joined = b"".join(bytes(as_bytes_view(p)) for p in parts)
    return Payload(parts), joined


def test_a_payload_is_its_parts_in_order_and_hashes_as_one_buffer() -> None:
    payload, joined = _parts(0)
    assert payload.nbytes == len(joined) and bytes(payload.joined()) == joined
    assert payload.xxh3() == xxhash.xxh3_64_intdigest(joined)
    dst = bytearray(len(joined))
    assert payload.copy_hashing_into(memoryview(dst)) == xxhash.xxh3_64_intdigest(joined)
    assert bytes(dst) == joined
    assert b"".join(bytes(s) for s in payload.slices(100_000)) == joined
    assert max(len(s) for s in payload.slices(100_000)) == 100_000
    with pytest.raises(ValueError):  # a view of a non-contiguous tensor would not be its bytes
        Payload([torch.zeros(4, 4).t()])


@pytest.mark.parametrize("transport", ["tcp", "shm", "ucx"])
def test_parts_are_stored_as_their_concatenation(cluster, transport: str) -> None:
    master, _node = cluster
    single, single_bytes = _parts(1)
    batch = [_parts(10 + i) for i in range(3)]

    async def main() -> None:
        async with AsyncStoreClient(master.address, transport=transport) as client:
            assert await client.put(f"parts/{transport}/one".encode(), single)
            assert await client.get(f"parts/{transport}/one".encode()) == single_bytes
            keys = [f"parts/{transport}/b{i}".encode() for i in range(len(batch))]
            items = [PutItem(k, p) for k, (p, _) in zip(keys, batch, strict=True)]
            assert await client.batch_put(items) == [None] * len(items)
            for k, (_, want) in zip(keys, batch, strict=True):
                assert await client.get(k) == want
            found = await client.lookup([f"parts/{transport}/one".encode()])
            assert found.found[0].meta.checksum == xxhash.xxh3_64_intdigest(single_bytes)
            assert found.found[0].meta.size == len(single_bytes)

    asyncio.run(main())
