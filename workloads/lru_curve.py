"""Exact LRU hit-rate curves in one pass (Mattson's stack distances), for the configurations in which the
simulated store's LRU *is* a stack algorithm; everything else stays with one ``simulate()`` per point.

Why: a sweep of 20 LRU capacities is 20 replays through the index; a stack algorithm gives every
capacity from one pass, because the cache at capacity C is always "the most recent items that fit in C"
for one recency order shared by all capacities.

What the simulated store's LRU does (``workloads/sim.py`` over ``kvstore/index/prefix_index.pyx``):

- a request looks up blocks [0, cap) (``cap = (L - 1) // B``: never the block of the last prompt token),
  touches the MLA run it found (pure MLA: the usable prefix is the run), then puts its whole chain in
  order: a missing block is inserted (stamped now), a present one answers EXISTS and is *not* touched;
- eviction is leaf-first in LRU order; every block of one request carries the same time, so the order
  among them is deepest first (a parent outlives its child);
- with ``high == low`` watermark w the pool evicts to fit ``int(w x C)`` (for w < 1 only while no object
  is larger than ``C - int(w x C)``, else ``_make_room`` cuts deeper); with the default 0.95 / 0.85 it
  drains in batches whose timing depends on C (not modelled here: fallback).

So the recency order is capacity-independent except for one rule: a block at or past ``cap`` (the last
prompt block, a reply's blocks) is refreshed only when it is *absent*. Where such a put-only block has been
seen before, it is present at the capacities above its stack distance and absent below: the capacities of
a stack that straddle it get different orders from then on. We then **split** the stack (a copy of the
Fenwick tree and positions per group of capacities whose histories agree), so the pass stays exact; the
worst case is one stack per capacity, still no index.

Per request and stack: the distance of block j is B_j = the capacity units of every item referenced no
earlier than j's last reference (j included), a suffix sum over a Fenwick tree indexed by reference
position; a block is cached at C_eff iff B_j <= C_eff, and the prefix rule is the running maximum
M_j = max(B_0..B_j): the run at C_eff is the number of j < cap with M_j <= C_eff. Blocks of a request are
then re-referenced at fresh positions, deepest lowest. O(blocks x log(references)).

Exact only when: pure MLA (hybrid: the lookup touches only the usable prefix, not the MLA run past it, and
checkpoints are written where a capacity-dependent lookup fell short), policy ``lru``, ``high == low``,
one master, DRAM only, no visibility delay, no client hints in effect, every key one size, no key twice in
one chain, and C_eff >= the largest request's units (a chain longer than the cache evicts itself, leaving
orphans). ``refusal`` names the first condition a configuration breaks; per capacity, ``exact_from``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.workloads.chains import ChainBuilder
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.sim_config import SimConfig
from kvpool.workloads.sim_result import Counters
from kvpool.workloads.trace import Request

_NEVER = 1 << 62  # the distance of a block never referenced before (misses at every capacity)


def refusal(config: SimConfig, requests: Sequence[Request]) -> str | None:
    """Why the one-pass curve cannot stand for ``simulate(requests, config)`` at any capacity, or None.
    (Per-capacity limits: :func:`exact_floor`.)"""
    if config.policy != "lru":
        return f"policy {config.policy!r} is not LRU"
    if config.spec.hybrid:
        return (
            "hybrid spec: the lookup touches only the usable prefix (not the MLA run past it) and "
            "checkpoints are written where a capacity-dependent lookup fell short (--pure-mla takes the "
            "one-pass curve)"
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
class _Req:
    """One request as the pass reads it: key ids in chain order, capacity units and real bytes per block,
    tokens per block, how many blocks the lookup reads and how many belong to the prompt."""

    ids: list[int]
    units: list[int]
    cum_tokens: list[int]  # cum_tokens[i] = tokens of blocks [0, i)
    cum_real: list[int]  # cum_real[i] = real bytes of blocks [0, i)
    cap: int
    prompt_blocks: int
    req: Request


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


@dataclass(slots=True)
class _Stack:
    """One recency order (Fenwick tree of capacity units by reference position) shared by the capacities
    whose histories agree, with their tallies (index k = the k-th of ``ceffs``)."""

    ceffs: list[int]
    slots: list[int]  # index of each capacity in the caller's list
    tree: list[int]
    pos: list[int]  # key id -> last reference position (0 = never)
    total: int = 0
    hit_blocks: list[int] = field(default_factory=list)
    run_blocks: list[int] = field(default_factory=list)
    hit_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    written_bytes: list[int] = field(default_factory=list)
    written_objects: list[int] = field(default_factory=list)

    def split(self, keep: list[int]) -> _Stack:
        """A copy holding only the capacities at indexes ``keep``."""
        return _Stack(
            [self.ceffs[k] for k in keep],
            [self.slots[k] for k in keep],
            self.tree.copy(),
            self.pos.copy(),
            self.total,
            *([getattr(self, name)[k] for k in keep] for name in _TALLIES),
        )


_TALLIES = ("hit_blocks", "run_blocks", "hit_tokens", "cached_tokens", "written_bytes", "written_objects")


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
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_ms)
    prep = _prepare([requests[i] for i in order], config, block_size)
    if isinstance(prep, str):
        return {}, {c: prep for c in capacities}
    reqs, biggest_unit, biggest_req = prep.reqs, prep.biggest_unit, prep.biggest_req
    exact: list[tuple[int, int]] = []  # (capacity, C_eff)
    fallback: dict[int, str] = {}
    for cap in dict.fromkeys(capacities):
        ceff = effective_capacity(config, cap)
        if ceff < biggest_req:
            fallback[cap] = (
                f"capacity {cap} keeps {ceff} units, less than the largest request's {biggest_req}: its "
                "chain would evict itself"
            )
        elif config.low_watermark < 1.0 and biggest_unit > cap - ceff:
            fallback[cap] = f"an object of {biggest_unit} units does not fit above the watermark at {cap}"
        else:
            exact.append((cap, ceff))
    if not exact:
        return {}, fallback
    exact.sort(key=lambda ce: ce[1])
    n_pos = sum(len(r.ids) for r in reqs)
    first = _Stack([ce[1] for ce in exact], list(range(len(exact))), [0] * (n_pos + 1), [0] * (prep.keys + 1))
    for name in _TALLIES:
        setattr(first, name, [0] * len(exact))
    stacks = [first]
    base = 1
    for r in reqs:
        for st in list(stacks):
            new, lost = _step(st, r, base, n_pos)
            stacks.extend(new)
            for slot in lost:
                fallback[exact[slot][0]] = (
                    f"request {r.req.request_id} found some of its put-only blocks present and inserts the "
                    "rest: the present parent outlives its newer child (leaf-first), not in LRU order"
                )
        stacks = [st for st in stacks if st.ceffs]
        base += len(r.ids)
    return _points(prep, config, block_size, exact, stacks), fallback


@dataclass(slots=True)
class _Prepared:
    reqs: list[_Req]
    real_of: list[int]  # key id - 1 -> real bytes
    keys: int
    biggest_unit: int
    biggest_req: int


def _prepare(reqs: list[Request], config: SimConfig, bs: int) -> _Prepared | str:
    """Chains as key ids, with the sizes the index would hold; or a reason the pass cannot be exact."""
    spec = config.spec
    builder = ChainBuilder(spec.name, bs)
    ids: dict[bytes, int] = {}
    real_of: list[int] = []
    out: list[_Req] = []
    biggest_unit = biggest_req = 0
    in_blocks = config.capacity_unit == "blocks"
    for req in reqs:
        if req.tokens is None and req.block_size != bs:
            raise ReplayError(
                f"request {req.request_id}: its blocks are {req.block_size} tokens, the run's are {bs}; "
                "hash-id records with different block sizes cannot share one cache"
            )
        chain = builder.chain(req, with_output=config.store_output)
        cap = min((req.input_length - 1) // bs, chain.prompt_blocks) if req.input_length else 0
        kid: list[int] = []
        units: list[int] = []
        cum_t, cum_r = [0], [0]
        for h, tokens in zip(chain.hashes, chain.block_tokens, strict=True):
            real = tokens * spec.mla_bytes_per_token
            k = ids.get(h)
            if k is None:
                k = ids[h] = len(ids) + 1  # 1-based: 0 in positions means never referenced
                real_of.append(real)
            elif real_of[k - 1] != real:
                return f"block {h[:6].hex()}… comes with {tokens} tokens and another size before"
            kid.append(k)
            units.append(1 if in_blocks else real)
            cum_t.append(cum_t[-1] + tokens)
            cum_r.append(cum_r[-1] + real)
        if len(set(kid)) != len(kid):
            return f"request {req.request_id} names one block twice in its chain"
        biggest_unit = max(biggest_unit, *units) if units else biggest_unit
        biggest_req = max(biggest_req, sum(units))
        out.append(_Req(kid, units, cum_t, cum_r, cap, chain.prompt_blocks, req))
    return _Prepared(out, real_of, len(ids), biggest_unit, biggest_req)


def _step(st: _Stack, r: _Req, base: int, n_pos: int) -> tuple[list[_Stack], list[int]]:
    """One request through one stack: tally every capacity, then re-reference its blocks. Returns the new
    stacks split off (capacities that found a different number of its put-only blocks present) and the
    capacities (caller's indexes) dropped because the stack cannot follow them any further."""
    tree, pos, total = st.tree, st.pos, st.total
    # running maximum of the stack distances along the chain (the prefix rule)
    run_max: list[int] = []
    m = 0
    for k in r.ids:
        p = pos[k]
        if p:
            s, i = 0, p - 1  # units referenced before position p
            while i:
                s += tree[i]
                i &= i - 1
            d = total - s
        else:
            d = _NEVER
        m = d if d > m else m
        run_max.append(m)
    cap, n, prompt = r.cap, len(r.ids), r.prompt_blocks
    lookup = run_max[:cap]
    present: list[int] = []  # per capacity: put-only blocks found present (not refreshed by the store)
    for k, ceff in enumerate(st.ceffs):
        run = bisect.bisect_right(lookup, ceff)
        held = bisect.bisect_right(run_max, ceff)  # blocks [0, held) cached: the run, then put-only ones
        extra = held - run  # > 0 only when run == cap
        full = run + min(extra, prompt - cap)
        st.hit_blocks[k] += full
        st.run_blocks[k] += run
        st.hit_tokens[k] += r.cum_tokens[full]
        st.cached_tokens[k] += r.cum_tokens[run]
        st.written_bytes[k] += r.cum_real[n] - r.cum_real[held]
        st.written_objects[k] += n - held
        present.append(extra)
    groups: dict[int, list[int]] = {}
    lost: list[int] = []
    for k, extra in enumerate(present):
        if 0 < extra < n - cap:  # some put-only blocks present, a deeper one inserted under them
            lost.append(st.slots[k])
        else:
            groups.setdefault(extra, []).append(k)
    out: list[_Stack] = []
    if lost or len(groups) > 1:
        parts = list(groups.items()) or [(0, [])]
        for extra, keep in parts[1:]:
            child = st.split(keep)
            _restamp(child, r, base, n_pos, extra)
            out.append(child)
        extra, keep = parts[0]
        for name in ("ceffs", "slots", *_TALLIES):
            values = getattr(st, name)
            setattr(st, name, [values[k] for k in keep])
        _restamp(st, r, base, n_pos, extra)
    else:
        _restamp(st, r, base, n_pos, present[0] if present else 0)
    return out, lost


def _restamp(st: _Stack, r: _Req, base: int, n_pos: int, extra: int) -> None:
    """Re-reference the request's blocks at positions base .. base+n-1, deepest lowest, except its
    ``extra`` put-only blocks from ``cap`` on that were present (the store answers EXISTS, no touch)."""
    tree, pos = st.tree, st.pos
    n, skip_lo, skip_hi = len(r.ids), r.cap, r.cap + extra
    added = 0
    for j, (k, w) in enumerate(zip(r.ids, r.units, strict=True)):
        if skip_lo <= j < skip_hi:
            continue
        p = pos[k]
        if p:
            i = p
            while i <= n_pos:
                tree[i] -= w
                i += i & -i
        else:
            added += w
        p = pos[k] = base + n - 1 - j
        i = p
        while i <= n_pos:
            tree[i] += w
            i += i & -i
    st.total += added


def _points(
    prep: _Prepared, config: SimConfig, bs: int, exact: list[tuple[int, int]], stacks: list[_Stack]
) -> dict[int, CurvePoint]:
    """Totals per capacity; what each stack holds at the end gives bytes held and evicted."""
    reqs, real_of = prep.reqs, prep.real_of
    base = Counters()
    for r in reqs:
        base.requests += 1
        base.input_tokens += r.req.input_length
        base.output_tokens += r.req.output_length
        base.input_blocks += r.prompt_blocks
    arrivals = [r.req.arrival_ms for r in reqs]
    duration = (max(arrivals) - min(arrivals)) / 1000.0 if arrivals else 0.0
    full_block = config.spec.mla_bytes_per_token * bs
    out: dict[int, CurvePoint] = {}
    for st in stacks:
        # every key by last position, newest first: a running sum of units is its distance at the end
        held_keys = sorted((p, k) for k, p in enumerate(st.pos) if p)
        units = [real_of[k - 1] if config.capacity_unit == "bytes" else 1 for _, k in held_keys]
        for k, ceff in enumerate(st.ceffs):
            cap = exact[st.slots[k]][0]
            acc = held_bytes = held_objects = 0
            for (_, key), u in zip(reversed(held_keys), reversed(units), strict=True):
                acc += u
                if acc > ceff:
                    break
                held_bytes += real_of[key - 1]
                held_objects += 1
            total = Counters(**{name: getattr(base, name) for name in ("requests", "input_tokens",
                             "output_tokens", "input_blocks")})  # fmt: skip
            total.hit_blocks = st.hit_blocks[k]
            total.usable_blocks = st.run_blocks[k]
            total.mla_hit_tokens = st.hit_tokens[k]
            total.cached_tokens = st.cached_tokens[k]
            total.mla_bytes_written = st.written_bytes[k]
            cap_bytes = cap * full_block if config.capacity_unit == "blocks" else cap
            out[cap] = CurvePoint(
                capacity=cap,
                capacity_bytes=cap_bytes,
                total=total,
                bytes_evicted=st.written_bytes[k] - held_bytes,
                objects_evicted=st.written_objects[k] - held_objects,
                bytes_held=held_bytes,
                duration_s=duration,
                block_size=bs,
            )
    return out
