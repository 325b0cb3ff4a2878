"""KV events on the wire: vLLM's KV-event format (``vllm/distributed/kv_events.py``, vLLM 0.32), as the
master publishes it and as a consumer reads it.

Why vLLM's format: routers that already exist (NVIDIA Dynamo's KV router and standalone indexer, llm-d's
precise prefix-cache scorer) learn what a cache holds from exactly this stream, so kvpool speaks it instead of
a format of its own. The convention, checked against the installed vLLM's classes (``tests/vllm_connector/
test_kv_events_vllm.py`` decodes every message with them):

* ZMQ PUB, one multipart message per batch: ``[topic, seq (8 bytes, big-endian), payload]``;
* payload = msgpack array ``[ts, events, data_parallel_rank]`` (``EventBatch`` is ``array_like``);
* each event a msgpack *map* tagged ``"type"`` (``KVCacheEvent`` is ``tag=True``, not ``array_like``):
  ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``,
  ``medium``, ``lora_name`` required; ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind`` optional),
  ``BlockRemoved`` (``block_hashes``, ``medium``, ``group_idx``), ``AllBlocksCleared``;
* replay: a ROUTER socket; a client sends the first sequence it wants (8 bytes, big-endian, signed) after an
  empty delimiter frame and gets ``[b"", topic, seq, payload]`` per batch, then ``[b"", b"", -1, b""]``.

kvpool's additions, all of them fields a vLLM decoder ignores (msgspec drops unknown map keys):

* ``block_index``: the logical index of the first block of ``block_hashes`` in its chain (0-based; block i
  covers tokens ``[i*B, (i+1)*B)``), or absent when the master does not know it (an object adopted before
  its parent). A checkpoint event (group :data:`GROUP_CHECKPOINT`) at ``block_index`` i says the recurrent
  state after token ``(i+1)*B`` is stored: the joint rule a consumer applies (docs/design/kv_events.md).
* the topic names the publisher: ``<prefix>/<shard>/<incarnation>``; a replay's snapshot messages use
  ``<prefix>/<shard>/<incarnation>/snapshot`` (the sequence they carry is the one the snapshot reflects).

Block hashes are the chained 32-byte hashes of ``cache/hashing.py`` (the key without its kind tag), sent as
bytes, or as vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` form (the hash's last 8 bytes as an unsigned
64-bit integer) for consumers that only take integers (Dynamo 1.6.1 refuses byte hashes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec

END_SEQ = -1  # replay: the last frame's sequence
SEQ_BYTES = 8
GROUP_MLA = 0  # the MLA blocks: an attention group, one block per B tokens
GROUP_CHECKPOINT = 1  # the KDA checkpoints: the recurrent state at the end of a block
SPEC_MLA = "mla_attention"  # vLLM KVCacheSpecKind.MLA_ATTENTION
SPEC_RECURRENT = "mamba"  # vLLM KVCacheSpecKind.MAMBA: the kind vLLM gives a recurrent-state group
MEDIUM_CPU = "CPU"  # vLLM MEDIUM_CPU
MEDIUM_STORAGE = "STORAGE"  # vLLM MEDIUM_STORAGE (Dynamo maps it, EXTERNAL and SHARED to its disk tier)
MEDIUM_EXTERNAL = "EXTERNAL"
SNAPSHOT_SUFFIX = b"/snapshot"


class KvEventsWireError(ValueError):
    """A message that is not a KV-event batch of this format (a consumer's error, never the master's)."""


class HashFormat(StrEnum):
    """How block hashes travel: the 32 bytes, or vLLM's 64-bit integer form."""

    BYTES = "bytes"
    INT64 = "int64"


def external_hash(block_hash: bytes, fmt: HashFormat) -> bytes | int:
    """The hash as the consumer sees it (vLLM's ``maybe_convert_block_hash``: big-endian, low 64 bits)."""
    if fmt is HashFormat.INT64:
        return int.from_bytes(block_hash[-8:], "big")
    return block_hash


def topic(prefix: str, shard: int, incarnation: str) -> bytes:
    """The publisher's identity: which store (prefix), which master shard, which life of it."""
    return f"{prefix}/{shard}/{incarnation}".encode()


def stored_event(
    hashes: Sequence[bytes | int],
    parent: bytes | int | None,
    token_ids: Sequence[int],
    block_size: int,
    medium: str,
    *,
    group: int,
    block_index: int | None,
    extra_keys: list[tuple[Any, ...] | None] | None,
) -> dict[str, Any]:
    """A ``BlockStored`` map: a run of consecutive blocks of one chain, one group, one medium."""
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "group_idx": group,
        "kv_cache_spec_kind": SPEC_RECURRENT if group == GROUP_CHECKPOINT else SPEC_MLA,
    }
    if extra_keys is not None:
        ev["extra_keys"] = extra_keys
    if block_index is not None:
        ev["block_index"] = block_index
    return ev


def removed_event(hashes: Sequence[bytes | int], medium: str, *, group: int) -> dict[str, Any]:
    """A ``BlockRemoved`` map."""
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium, "group_idx": group}


CLEARED_EVENT: dict[str, Any] = {"type": "AllBlocksCleared"}


_ENCODER = msgspec.msgpack.Encoder()  # what vLLM encodes these with: ~4x msgpack's speed on token lists
_DECODER = msgspec.msgpack.Decoder()


def encode_batch(ts: float, events: list[dict[str, Any]], data_parallel_rank: int) -> bytes:
    """The payload frame: ``[ts, events, data_parallel_rank]`` (bytes as msgpack bin, tuples as arrays)."""
    return _ENCODER.encode([ts, events, data_parallel_rank])


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise KvEventsWireError(f"a sequence is {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One decoded payload."""

    ts: float
    events: list[dict[str, Any]]
    data_parallel_rank: int | None


def decode_batch(payload: bytes) -> EventBatch:
    """Parse a payload frame; :class:`KvEventsWireError` if it is not one."""
    try:
        body = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise KvEventsWireError(f"payload is not msgpack: {exc}") from None
    if not isinstance(body, list) or len(body) not in (2, 3) or not isinstance(body[1], list):
        raise KvEventsWireError("payload is not [ts, events, data_parallel_rank]")
    events = body[1]
    for ev in events:
        if not isinstance(ev, dict) or ev.get("type") not in (
            "BlockStored",
            "BlockRemoved",
            "AllBlocksCleared",
        ):
            raise KvEventsWireError(f"not a KV event: {ev!r:.80}")
    return EventBatch(float(body[0]), events, body[2] if len(body) == 3 else None)
