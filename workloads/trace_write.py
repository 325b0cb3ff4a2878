"""Writing traces: kvpool JSONL (lossless) and Mooncake JSONL (what is lost is listed in ``trace``'s
docstring), with chained block ids recomputed from tokens and renumbered in first-seen order like the
published traces (``MooncakeIdMapper``). Gzip when the path ends in ``.gz``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from kvpool.workloads.errors import TraceFormatError
from kvpool.workloads.trace import open_text
from kvpool.workloads.trace_record import KVPOOL_FORMAT, MOONCAKE_BLOCK, Request


def to_kvpool_dict(req: Request) -> dict[str, Any]:
    """The JSON object written for ``req`` (absent optional fields are omitted)."""
    out: dict[str, Any] = {
        "format": KVPOOL_FORMAT,
        "request_id": req.request_id,
        "arrival_ms": req.arrival_ms,
        "tenant": req.tenant,
        "workload": req.workload,
        "input_length": req.input_length,
        "output_length": req.output_length,
    }
    if req.conversation_id is not None:
        out["conversation_id"] = req.conversation_id
        out["turn"] = req.turn
    if req.hash_ids is not None:
        out["block_size"] = req.block_size
        out["hash_ids"] = req.hash_ids
    if req.tokens is not None:
        out["tokens"] = req.tokens
    if req.output_tokens is not None:
        out["output_tokens"] = req.output_tokens
    if req.cache_key is not None:
        out["cache_key"] = req.cache_key
    if req.retention_tier is not None:
        out["retention_tier"] = req.retention_tier
        out["retention_ms"] = req.retention_ms
    if req.prefix_retention_tier is not None:
        out["retained_prefix_tokens"] = req.retained_prefix_tokens
        out["prefix_retention_tier"] = req.prefix_retention_tier
        out["prefix_retention_ms"] = req.prefix_retention_ms
    if req.session_end:
        out["session_end"] = True
    out.update(req.extra)
    return out


def write_kvpool(requests: Iterable[Request], path: str | Path) -> int:
    """Write kvpool JSONL (gzip if ``path`` ends in .gz); returns the number of records."""
    n = 0
    with open_text(path, "w") as fh:
        for req in requests:
            fh.write(json.dumps(to_kvpool_dict(req), separators=(",", ":")) + "\n")
            n += 1
    return n


class MooncakeIdMapper:
    """Chained block ids for requests that have tokens: SHA-256 over (parent, tenant, block tokens), then
    renumbered in first-seen order so the output looks like a published trace."""

    def __init__(self, block_size: int = MOONCAKE_BLOCK) -> None:
        if block_size <= 0:
            raise TraceFormatError("block size must be positive")
        self.block_size = block_size
        self._ids: dict[bytes, int] = {}

    def ids_for(self, req: Request) -> list[int]:
        if req.hash_ids is not None and req.block_size == self.block_size and req.tokens is None:
            return list(req.hash_ids)
        if req.tokens is None:
            raise TraceFormatError(
                f"request {req.request_id}: hash ids of block size {req.block_size} cannot be re-blocked "
                f"to {self.block_size} without tokens"
            )
        parent = hashlib.sha256(b"kvpool-mooncake-ids/1|" + req.tenant.encode()).digest()
        toks = np.asarray(req.tokens, dtype=np.uint64)
        out = []
        for start in range(0, len(toks), self.block_size):
            parent = hashlib.sha256(parent + toks[start : start + self.block_size].tobytes()).digest()
            out.append(self._ids.setdefault(parent, len(self._ids)))
        return out


def to_mooncake_dict(req: Request, mapper: MooncakeIdMapper) -> dict[str, Any]:
    """The Mooncake JSON object for ``req`` (arrival rounded to whole ms)."""
    return {
        "timestamp": round(req.arrival_ms),
        "input_length": req.input_length,
        "output_length": req.output_length,
        "hash_ids": mapper.ids_for(req),
    }


def write_mooncake(requests: Iterable[Request], path: str | Path, block_size: int = MOONCAKE_BLOCK) -> int:
    """Write Mooncake JSONL; see the module docstring for what is lost. Returns the number of records."""
    mapper = MooncakeIdMapper(block_size)
    n = 0
    with open_text(path, "w") as fh:
        for req in requests:
            fh.write(json.dumps(to_mooncake_dict(req, mapper)) + "\n")
            n += 1
    return n
