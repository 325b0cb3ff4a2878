"""Exact LRU hit-rate curves in one pass (Mattson's stack distances), for the configurations in which the
simulated store's LRU *is* a stack algorithm; everything else stays with one ``simulate()`` per point.

Why: a sweep of 20 LRU capacities is 20 replays through the index; a stack algorithm gives every
capacity from one pass, because the cache at capacity C is always "the most recent items that fit in C"
for one recency order shared by all capacities.

What the simulated store's LRU does (``workloads/sim.py`` over ``kvstore/index/prefix_index.pyx``):

- a request looks up blocks [0, cap) (``cap = (L - 1) // B``: never the block of the last prompt token),
  touches the MLA run it found (pure MLA: the usable prefix is the run), then puts its whole chain in
  order: a missing block is inserted (stamped now), a present one answers EXISTS and is touched (the
  writer used it: the store's rule, in the master as in the simulator);
- eviction is leaf-first in LRU order; every block of one request carries the same time, so the order
  among them is deepest first (a parent outlives its child);
- with ``high == low`` watermark w the pool evicts to fit ``int(w x C)`` (for w < 1 only while no object
  is larger than ``C - int(w x C)``, else ``_make_room`` cuts deeper); with the default 0.95 / 0.85 it
  drains in batches whose timing depends on C (not modelled here: fallback).

So every block of a request is re-referenced whatever the capacity, and the recency order is one for all
capacities: a stack. The pass itself is compiled (``workloads/lru_stack.pyx``, checked against the plain
``tests/oracle/lru_stack.py``); here the trace becomes its arrays, one key id per distinct block: for
hash-id records the pair (tenant, trace id), on which the simulator's chain hash depends alone
(``chains.ChainBuilder``), for token records the chain hash. O(blocks x log(cache size)).

Exact only when: pure MLA (hybrid: checkpoints are written where a capacity-dependent lookup fell short),
policy ``lru``, ``high == low``, one master, DRAM only, no visibility delay, no client hints in effect, no
block put at another size while some capacity holds it, no key twice in one chain, and C_eff >= the largest
request's units (a chain longer than the cache evicts itself, leaving orphans). ``refusal`` names the first
condition a configuration breaks; ``lru_curve`` the capacities and traces it cannot take, and why.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from kvpool.workloads.chains import ChainBuilder
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.lru_stack import NotAStack, stack_pass
from kvpool.workloads.sim_config import SimConfig
from kvpool.workloads.sim_result import Counters
from kvpool.workloads.trace import Request


def refusal(config: SimConfig, requests: Sequence[Request]) -> str | None:
    """Why the one-pass curve cannot stand for ``simulate(requests, config)`` at any capacity, or None.
    (Per-capacity and per-trace limits: :func:`lru_curve`'s fallback reasons.)"""
    if config.policy != "lru":
        return f"policy {config.policy!r} is not LRU"
    if config.spec.hybrid:
        return (
            "hybrid spec: checkpoints are written where a capacity-dependent lookup fell short, so what "
            "is stored depends on the capacity (--pure-mla takes the one-pass curve)"
        )
    if config.high_watermark != config.low_watermark:
        return (
            f"watermarks {config.high_watermark} / {config.low_watermark}: batch eviction is not a stack "
            "algorithm (use --high-watermark 1 --low-watermark 1)"
        )
    if config.ssd_capacity:
        return "an SSD tier demotes instead of evicting"
    if config.shards.count != 1:
        return "master shards split the capacity"
    if config.visibility_delay_ms:
        return "a visibility delay reorders stores and lookups"
    if config.hints and any(r.has_hints for r in requests):
        return "client retention hints pin objects (use --no-hints)"
    return None


@dataclass(slots=True)
class CurvePoint:
    """One capacity of the curve: the counters a sweep row reads (totals; no per-request columns)."""

    capacity: int
    capacity_bytes: int | None
    total: Counters
    bytes_evicted: int
    objects_evicted: int
    bytes_held: int
    duration_s: float
    block_size: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.total.requests,
            **self.total.to_dict(),
            "bytes_evicted": self.bytes_evicted,
            "objects_evicted": self.objects_evicted,
            "objects_refused": 0,
            "bytes_held": self.bytes_held,
            "capacity_bytes": self.capacity_bytes,
            "duration_s": self.duration_s,
            "one_pass": True,
        }


def effective_capacity(config: SimConfig, capacity: int) -> int:
    """Units an evict-to-fit pool keeps at ``capacity``: ``int(w x C)``, the index's own expression."""
    return int(config.low_watermark * capacity)


def lru_curve(
    requests: Sequence[Request], config: SimConfig, capacities: Sequence[int], block_size: int
) -> tuple[dict[int, CurvePoint], dict[int, str]]:
    """The points of ``capacities`` that one pass computes exactly (``{capacity: CurvePoint}``) and, for
    the others, why not (``{capacity: reason}``): the caller simulates those. ``config``'s capacity is
    ignored; ``block_size`` is the run's (``sim.effective_block_size``)."""
    why = refusal(config, requests)
    if why is not None:
        return {}, {c: why for c in capacities}
    ordered = [requests[i] for i in sorted(range(len(requests)), key=lambda i: requests[i].arrival_ms)]
    prep = _prepare(ordered, config, block_size)
    exact: list[tuple[int, int]] = []  # (capacity, C_eff)
    fallback: dict[int, str] = {}
    for cap in dict.fromkeys(capacities):
        ceff = effective_capacity(config, cap)
        if ceff < prep.biggest_req:
            fallback[cap] = (
                f"capacity {cap} keeps {ceff} units, less than the largest request's {prep.biggest_req}: "
                "its chain would evict itself"
            )
        elif config.low_watermark < 1.0 and prep.biggest_unit > cap - ceff:
            fallback[cap] = (
                f"an object of {prep.biggest_unit} units does not fit above the watermark at {cap}"
            )
        else:
            exact.append((cap, ceff))
    if not exact:
        return {}, fallback
    exact.sort(key=lambda ce: ce[1])
    try:
        tallies = stack_pass(
            prep.offsets, prep.keys, prep.tokens, prep.caps, prep.prompts, prep.n_keys,
            np.array([ce[1] for ce in exact], np.int64), config.spec.mla_bytes_per_token,
            config.capacity_unit == "bytes",
        )  # fmt: skip
    except NotAStack as exc:
        why = f"request {ordered[exc.request].request_id} {exc.why}"
        return {}, {c: why for c in capacities}
    return _points(ordered, prep, config, block_size, exact, tallies), fallback


@dataclass(slots=True)
class _Prepared:
    """The trace as the pass reads it, in arrival order: request r's blocks are ``keys[offsets[r]:
    offsets[r + 1]]`` (1-based key ids, chain order) of ``tokens`` each; its lookup reads ``caps[r]``
    blocks, ``prompts[r]`` of them belong to the prompt."""

    offsets: np.ndarray
    keys: np.ndarray
    tokens: np.ndarray
    caps: np.ndarray
    prompts: np.ndarray
    n_keys: int
    biggest_unit: int  # the largest block, in capacity units (a capacity must fit it above the watermark)
    biggest_req: int  # the largest request's units (a smaller cache evicts the request's own chain)


def _prepare(reqs: list[Request], config: SimConfig, bs: int) -> _Prepared:
    """``reqs`` (in arrival order) as arrays, with the sizes the index would hold. Hash-id records are
    taken column-wise (a production trace is tens of millions of ids); token records are hashed as the
    simulator hashes them."""
    for req in reqs:
        if req.tokens is None and req.block_size != bs:
            raise ReplayError(
                f"request {req.request_id}: its blocks are {req.block_size} tokens, the run's are {bs}; "
                "hash-id records with different block sizes cannot share one cache"
            )
    by_id = [r for r in reqs if r.tokens is None]
    id_keys, id_lengths, n_id_keys = _id_keys(by_id)
    token_blocks = _token_blocks([r for r in reqs if r.tokens is not None], config, bs, n_id_keys)
    n_keys = n_id_keys + token_blocks.n_keys
    id_at = np.zeros(len(id_lengths) + 1, np.int64)
    np.cumsum(id_lengths, out=id_at[1:])
    lengths = np.empty(len(reqs), np.int64)
    prompts = np.empty(len(reqs), np.int32)
    inputs = np.fromiter((r.input_length for r in reqs), np.int64, len(reqs))
    is_id = np.fromiter((r.tokens is None for r in reqs), bool, len(reqs))
    lengths[is_id] = id_lengths
    lengths[~is_id] = token_blocks.lengths
    prompts[is_id] = id_lengths
    prompts[~is_id] = token_blocks.prompts
    offsets = np.zeros(len(reqs) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if is_id.all():
        keys = id_keys
        tokens = np.full(len(keys), bs, np.int32)
    else:  # a mix: each request's blocks from its own kind, in arrival order
        pieces: list[np.ndarray] = []
        tok_pieces: list[np.ndarray] = []
        i_id = i_tok = 0
        for flag in is_id.tolist():
            if flag:
                pieces.append(id_keys[id_at[i_id] : id_at[i_id + 1]])
                tok_pieces.append(np.full(id_lengths[i_id], bs, np.int32))
                i_id += 1
            else:
                pieces.append(token_blocks.keys[i_tok])
                tok_pieces.append(token_blocks.tokens[i_tok])
                i_tok += 1
        keys = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
        tokens = np.concatenate(tok_pieces) if tok_pieces else np.zeros(0, np.int32)
    # a hash-id record's last block holds what is left of its prompt
    tail = inputs % bs
    partial = is_id & (lengths > 0) & (tail > 0)
    tokens[offsets[1:][partial] - 1] = tail[partial]
    caps = np.where(inputs > 0, np.minimum((inputs - 1) // bs, prompts), 0).astype(np.int32)
    if config.capacity_unit == "bytes":
        units = tokens.astype(np.int64) * config.spec.mla_bytes_per_token
        running = np.zeros(len(units) + 1, np.int64)
        np.cumsum(units, out=running[1:])
        per_req = running[offsets[1:]] - running[offsets[:-1]]
    else:
        units, per_req = np.ones(len(keys), np.int64), lengths
    return _Prepared(
        offsets, keys, tokens, caps, prompts, n_keys,
        biggest_unit=int(units.max()) if len(units) else 0,
        biggest_req=int(per_req.max()) if len(per_req) else 0,
    )  # fmt: skip


def _id_keys(reqs: list[Request]) -> tuple[np.ndarray, np.ndarray, int]:
    """Hash-id records' blocks as key ids 1..K, one per distinct (tenant, trace id) in first-seen order,
    end to end; the blocks per record; K."""
    import pyarrow as pa  # a dependency (Parquet traces); imported, as there, only where it is used

    lengths = np.fromiter((len(r.hash_ids or ()) for r in reqs), np.int64, len(reqs))
    total = int(lengths.sum())
    ids: Any = [r.hash_ids for r in reqs]
    try:
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, total)
    except OverflowError:  # ids past 2^63 - 1: numbered first (a trace's ids are labels, not quantities)
        if max(map(max, filter(None, ids))) >= 1 << 64:
            raise ReplayError("a hash id does not fit 64 bits (the simulator's chain hash takes 8)") from None
        seen: dict[int, int] = {}
        flat = np.fromiter(
            (seen.setdefault(i, len(seen)) for i in itertools.chain.from_iterable(ids)), np.int64, total
        )
    tenants = {r.tenant for r in reqs}
    if len(tenants) > 1:  # the same id under two tenants is two blocks (the tenant's root is in the hash)
        code = {t: i for i, t in enumerate(sorted(tenants))}
        per_block = np.repeat(np.fromiter((code[r.tenant] for r in reqs), np.int64, len(reqs)), lengths)
        dense = pa.array(flat).dictionary_encode().indices.to_numpy().astype(np.int64)
        flat = dense * len(tenants) + per_block
    encoded = pa.array(flat).dictionary_encode()
    keys = encoded.indices.to_numpy().astype(np.int32) + 1
    return keys, lengths, len(encoded.dictionary)


@dataclass(slots=True)
class _TokenBlocks:
    """Token records' chains, one array of key ids and one of tokens per record, in arrival order."""

    keys: list[np.ndarray]
    tokens: list[np.ndarray]
    lengths: np.ndarray
    prompts: np.ndarray
    n_keys: int


def _token_blocks(reqs: list[Request], config: SimConfig, bs: int, first_key: int) -> _TokenBlocks:
    """Token records' chains (as ``simulate`` hashes them) as key ids from ``first_key + 1`` on."""
    builder = ChainBuilder(config.spec.name, bs)
    ids: dict[bytes, int] = {}
    keys, tokens, lengths, prompts = [], [], [], []
    for req in reqs:
        chain = builder.chain(req, with_output=config.store_output)
        keys.append(
            np.fromiter((ids.setdefault(h, first_key + len(ids) + 1) for h in chain.hashes), np.int32)
        )
        tokens.append(np.array(chain.block_tokens, np.int32))
        lengths.append(len(chain.hashes))
        prompts.append(chain.prompt_blocks)
    return _TokenBlocks(keys, tokens, np.array(lengths, np.int64), np.array(prompts, np.int32), len(ids))


def _points(
    reqs: list[Request],
    prep: _Prepared,
    config: SimConfig,
    bs: int,
    exact: list[tuple[int, int]],
    tallies: dict[str, np.ndarray],
) -> dict[int, CurvePoint]:
    """Totals per capacity."""
    input_tokens = sum(r.input_length for r in reqs)
    input_blocks = int(prep.prompts.sum())
    output_tokens = sum(r.output_length for r in reqs)
    duration = (reqs[-1].arrival_ms - reqs[0].arrival_ms) / 1000.0 if reqs else 0.0
    full_block = config.spec.mla_bytes_per_token * bs
    out: dict[int, CurvePoint] = {}
    for c, (cap, _) in enumerate(exact):
        total = Counters()
        total.requests, total.input_tokens, total.output_tokens = len(reqs), input_tokens, output_tokens
        total.input_blocks = input_blocks
        total.hit_blocks = int(tallies["hit_blocks"][c])
        total.usable_blocks = int(tallies["run_blocks"][c])
        total.mla_hit_tokens = int(tallies["hit_tokens"][c])
        total.cached_tokens = int(tallies["cached_tokens"][c])
        total.mla_bytes_written = int(tallies["written_bytes"][c])
        held_bytes = int(tallies["held_bytes"][c])
        out[cap] = CurvePoint(
            capacity=cap,
            capacity_bytes=cap * full_block if config.capacity_unit == "blocks" else cap,
            total=total,
            bytes_evicted=total.mla_bytes_written - held_bytes,
            objects_evicted=int(tallies["written_objects"][c] - tallies["held_objects"][c]),
            bytes_held=held_bytes,
            duration_s=duration,
            block_size=bs,
        )
    return out
