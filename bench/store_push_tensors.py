"""The prefill push as the worker makes it: from model tensors to stored cache units, for the store bench.

``store_ours``' push rows put ready-made byte payloads. A prefill holds tensors: every MLA block and the
checkpoint must first become a cache unit (header, padding, tensor bytes, checksum). This measures that whole
step, two ways, in the same run:

* ``tensors_assembled``: each unit encoded into a buffer of its own (``encode_mla_block`` /
  ``encode_kda_checkpoint``), then one ``batch_put`` — the worker's path before issue #18;
* ``tensors_parts``: the worker's path now (``worker.store_push.block_items`` / ``checkpoint_items``): each
  unit a ``Payload`` of its header and views of the tensors, put with no assembly copy.

Shape: K3 at the push scale (default 1/4): 24 MLA layers x 576 bf16 latents per token, 24 blocks of 128
tokens (3.5 MB each), and 69 KDA layers of [24, 128, 128] fp32 state + bf16 conv rows (107 MiB).
Every rep reads the checkpoint back and decodes it against the tensors it came from.
"""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import time
from typing import Any

import torch
from store_common import VerifyError, gbps

BLOCKS = 24


def k3_schema(scale: float) -> Any:
    from kvpool.model.cache_schema import CacheSchema

    heads = max(1, round(96 * scale))
    return CacheSchema(
        fingerprint=bytes(32),
        mla_layers=(*range(3, 92, 4), 92),
        latent_dim=576,
        mla_dtype="bfloat16",
        kda_layers=tuple(i for i in range(92) if i % 4 != 3),
        state_shape=(heads, 128, 128),
        conv_shape=(3, 3 * heads * 128),
        conv_dtype="bfloat16",
        block_size=max(1, round(512 * scale)),
    )


def make_request(schema: Any) -> tuple[dict[int, torch.Tensor], Any]:
    from kvpool.model.state import KDACheckpoint, KDALayerState

    gen = torch.Generator().manual_seed(18)
    tokens = BLOCKS * schema.block_size
    latents = {
        lid: torch.randn(tokens, schema.latent_dim, generator=gen).to(torch.bfloat16)
        for lid in schema.mla_layers
    }
    layers = {
        lid: KDALayerState(
            recurrent=torch.randn(schema.state_shape, generator=gen),
            conv=torch.randn(schema.conv_shape, generator=gen).to(torch.bfloat16),
        )
        for lid in schema.kda_layers
    }
    return latents, KDACheckpoint(n_tokens=tokens, layers=layers)


def _items(mode: str, schema: Any, latents: Any, ckpt: Any, hashes: list[bytes], tenant: str) -> list[Any]:
    from kvpool.cache.units import encode_kda_checkpoint, encode_mla_block
    from kvpool.kvstore.client.async_client import PutItem
    from kvpool.kvstore.keys import kda_key, mla_key
    from kvpool.proto import common_pb2
    from kvpool.worker.store_push import block_items, checkpoint_items

    if mode == "tensors_parts":
        return [
            *block_items(schema, hashes, latents, 0, BLOCKS, tenant),
            *checkpoint_items(schema, hashes, [ckpt], tenant),
        ]
    B = schema.block_size
    items = []
    for i in range(BLOCKS):
        block = {lid: rows[i * B : (i + 1) * B].contiguous() for lid, rows in latents.items()}
        data = encode_mla_block(schema, i, block, block_hash=hashes[i])
        items.append(PutItem(mla_key(hashes[i]), data, common_pb2.MLA_BLOCK, tenant))
    data = encode_kda_checkpoint(schema, ckpt, block_hash=hashes[-1])
    items.append(PutItem(kda_key(hashes[-1]), data, common_pb2.KDA_CHECKPOINT, tenant))
    return items


async def measure(client: Any, transport: str, scale: float, reps: int, warmup: int) -> dict[str, float]:
    """GB/s (unit bytes / wall time from tensors to committed objects) per mode, modes interleaved."""
    from kvpool.cache.units import decode_kda_checkpoint

    schema = k3_schema(scale)
    latents, ckpt = make_request(schema)
    times: dict[str, list[float]] = {"tensors_assembled": [], "tensors_parts": []}
    total = 0
    for rep in range(warmup + reps):
        for mode in times:
            name = f"push-tensors/{transport}/{mode}/{rep}"  # fresh keys: nothing deduplicated
            hashes = [hashlib.sha256(f"{name}/{i}".encode()).digest() for i in range(BLOCKS)]
            t0 = time.perf_counter()
            items = _items(mode, schema, latents, ckpt, hashes, "")
            errors = [e for e in await client.batch_put(items) if e is not None]
            dt = time.perf_counter() - t0
            if errors:
                raise VerifyError(f"tensor push ({mode}): {errors[0]!r}")
            total = sum(item.nbytes for item in items)
            back = decode_kda_checkpoint(await client.get(items[-1].key), schema, expected_hash=hashes[-1])
            for lid, st in ckpt.layers.items():
                if not torch.equal(back.layers[lid].recurrent, st.recurrent):
                    raise VerifyError(f"tensor push ({mode}): layer {lid} state differs after the round trip")
            await client.remove([item.key for item in items])
            await asyncio.sleep(0.2)
            if rep >= warmup:
                times[mode].append(dt)
    return {mode: gbps(total, statistics.median(ts)) for mode, ts in times.items()}
