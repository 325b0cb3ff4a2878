"""Simulated replay: requests through the master's own ``PrefixIndex`` + eviction, no model compute.

Per request, in arrival order (index clock = arrival seconds + 1 µs x sequence number, so every request
has its own instant even when a trace stamps many with the same millisecond):

1. **Lookup**: ``match_prefix`` over the prompt's block chain (joint rule for a hybrid spec: MLA blocks
   [0, p) plus a KDA checkpoint closing block p-1; plain MLA run for a pure-MLA spec).
2. **Count**: the MLA run (the Mooncake "prefix hit": a block counts only if every earlier block of the
   request hit), the usable prefix p (what prefill may skip, what ``cached_tokens`` reports), and the
   tokens lost between them to a missing checkpoint.
3. **Store**: the whole prompt is stored: missing blocks are inserted in prefix order (parent = previous
   block); present ones are refreshed, as the master answers EXISTS to a duplicate put and refreshes the
   object (the writer used it). Recency is refreshed by the fetch of the usable prefix
   (``match_prefix(touch=True)``, what prefill's acquire does), by inserts and by those puts. With
   ``store_output`` and token records that carry ``output_tokens``, the blocks the reply closes are stored
   too (decode pushes them).
4. **Checkpoints** (``CheckpointPolicy``), only at boundaries the request computes itself (c > p):
   end of prompt (last full prompt block), end of output, junction (c = MLA run when the run passed the
   last checkpoint), every N blocks.
5. **Client hints** (``SimConfig.hints``, docs/design/eviction.md §1.3), once its objects are stored: a
   request with a retention tier pins its chain (the MLA blocks up to its deepest checkpoint, and that
   checkpoint) for ``retention_ms`` under its session (``cache_key``, else the request's own); a retained
   prefix pins the same way up to the prefix's last block, for ``prefix_retention_ms``, under the same
   session. A ``session_end`` releases everything the session holds, so a prefix outlives a session only
   while another session pins it too. As on the master, a chain with a key not in the index pins nothing
   (no refusal); the index refuses a pin over its budget: counted, and the request goes on.

Requests come as a list (sorted here) or as any iterable, which is *streamed*: replayed as it is read,
through a bounded reorder window (``trace.arrival_ordered``), so a trace larger than memory runs in the
memory of the index plus a few integers per request (the per-request columns pricing needs).

Every result carries a TTFT estimate per request (``workloads/ttft.py``: the usable prefix loaded from
its tier, the rest recomputed at the spec's FLOPs), overall and per workload.

Capacity is bytes from the spec (MLA block = tokens x MLA bytes/token, checkpoint = KDA bytes) or
"blocks": every MLA object is one unit and a checkpoint weighs ceil(KDA bytes / full MLA block bytes)
units. Eviction (policy, watermarks, leaf-first) is entirely the index's.
"""

from __future__ import annotations

import heapq
import itertools
import math
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from kvpool.kvstore.index.prefix_index import PrefixIndex
from kvpool.kvstore.index.records import PUT_NO_ROOM, PUT_NOT_ADMITTED, StoreIndexError, Tier
from kvpool.kvstore.keys import MLA_TAG
from kvpool.workloads import trace
from kvpool.workloads.chains import Chain, ChainBuilder, model_fingerprint
from kvpool.workloads.checkpoints import checkpoint_positions
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.labels import YARDSTICKS, LabelsPolicy, ReuseOracle
from kvpool.workloads.sim_config import SimConfig
from kvpool.workloads.sim_result import Counters, SimResult
from kvpool.workloads.specs import ModelSpec
from kvpool.workloads.trace import Request, arrival_ordered

INFINITE = 1 << 62
NODE = "sim"


class _Clock:
    """The simulated time, set per request. The index reads it through ``read``, a plain closure: it asks
    several times per put, and an instance's ``__call__`` costs twice a function's."""

    def __init__(self) -> None:
        self.now = 0.0
        self.read: Callable[[], float] = lambda: self.now


@dataclass(slots=True)
class HintTally:
    """What the client hints did in one simulation (all zero when the trace has none or they are off)."""

    pins: int = 0  # pin calls, as the serving path makes them (one more where a chain was incomplete)
    pins_refused: int = 0  # of them, refused by the index's pin budget (the request still ran)
    pins_incomplete: int = 0  # of them, on a chain with a key not in the index: nothing pinned, no refusal
    objects_pinned: int = 0  # objects the accepted calls pinned (counted once per call)
    sessions_ended: int = 0
    objects_released: int = 0  # objects the ended sessions held (another holder may still pin one)

    def to_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


@dataclass(slots=True)
class _SessionPins:
    """What one session pins on one index: its latest chain and the retained prefixes it sent."""

    chain: set[bytes] = field(default_factory=set)
    prefix: set[bytes] = field(default_factory=set)


@dataclass(slots=True)
class _Store:
    """What a request will write once it finishes (decided at its lookup)."""

    req: Request
    chain: Chain
    run: int
    usable: int
    existing: tuple[int, ...]  # block counts with a checkpoint the lookup found (prefill's candidates too)
    owner: int  # its (workload, tenant) pair: an index of ``_Replay.owners``
    shard: int  # the master shard its chain routes to (always 0 with one master)


class _Replay:
    """One simulation's state: the index, the chains, the counters, the stores not yet visible."""

    def __init__(
        self,
        config: SimConfig,
        block_size: int,
        oracle: ReuseOracle | None = None,
        chains: ChainBuilder | None = None,
    ) -> None:
        config.check()
        self.config = config
        spec = self.spec = config.spec
        self.block_size = block_size
        full_block_bytes = spec.mla_bytes_per_token * self.block_size
        if config.capacity_unit == "blocks":
            self.kda_size = math.ceil(spec.kda_bytes_per_checkpoint / full_block_bytes) if spec.hybrid else 0
            self.capacity_bytes = None if config.capacity is None else config.capacity * full_block_bytes
        else:
            self.kda_size = spec.kda_bytes_per_checkpoint
            self.capacity_bytes = config.capacity
        self.in_blocks = config.capacity_unit == "blocks"
        self.clock = _Clock()
        # One index per master shard, each holding its slice of the capacity (a node's pool is split evenly
        # between the shards that place objects on it); one shard is the plain single master.
        shards = config.shards
        dram = config.capacity // shards.count if config.capacity is not None else INFINITE
        self.shard_indexes = [
            PrefixIndex(
                LabelsPolicy(oracle) if oracle is not None else config.policy,
                high_watermark=config.high_watermark,
                low_watermark=config.low_watermark,
                clock=self.clock.read,
                keep_events=False,  # what an eviction takes is settled once at the end (``settle``)
                admission=config.admission if config.policy in ("hybrid", *YARDSTICKS) else None,
                pin_share=config.pin_share,
                pin_budget_step=config.pin_budget_step,
            )
            for _ in range(shards.count)
        ]
        for idx in self.shard_indexes:
            idx.add_node(NODE, dram, config.ssd_capacity // shards.count)
        self.shard_lookups = [0] * shards.count
        self.shard_bytes_written = [0] * shards.count
        if chains is not None and (chains.block_size, chains.fingerprint) != (
            self.block_size,
            model_fingerprint(spec.name),
        ):
            raise ReplayError(
                f"the shared chains are of another spec or block size than {spec.name} at {block_size}"
            )
        self.builder = chains if chains is not None else ChainBuilder(spec.name, self.block_size)
        # Tallies per (workload, tenant) pair, summed per workload and per tenant at the end; what each
        # object costs its writer is kept by slot (one array per shard, as the index's slots), so an eviction
        # needs no call: what a pair's objects lost is what it wrote minus what is still held (``settle``)
        self.owner_ids: dict[tuple[str, str], int] = {}
        self.owners: list[Counters] = []
        # (C arrays: 12 bytes a slot, where lists of ints would hold a pointer and an int object each)
        self.slot_owner: list[array[int]] = [array("i") for _ in range(shards.count)]
        self.slot_bytes: list[array[int]] = [array("q") for _ in range(shards.count)]
        self.objects_written = 0
        self.refused = self.not_admitted = 0
        self.hints = HintTally()
        self.session_pins: dict[tuple[int, str, str], _SessionPins] = {}  # (index, tenant, session) -> keys
        columns = "workload arrival_ms input cached output dram_bytes ssd_bytes"
        columns += " write_tier prefix_tokens prefix_tier"  # the tiers the bill prices written tokens at
        self.per_req: dict[str, list[Any]] = {k: [] for k in columns.split()}
        self.per_req_columns = [self.per_req[k] for k in columns.split()]  # what ``lookup`` appends to
        self.shards, self.sharded = shards, shards.sharded

    def _owner(self, req: Request) -> int:
        pair = (req.workload, req.tenant)
        o = self.owner_ids.get(pair)
        if o is None:
            o = self.owner_ids[pair] = len(self.owners)
            self.owners.append(Counters())
        return o

    def lookup(self, req: Request) -> _Store:
        """Match the prompt (as prefill would, at the index's current time) and count the hit."""
        bs = self.block_size
        if req.tokens is None and req.block_size != bs:
            raise ReplayError(
                f"request {req.request_id}: its blocks are {req.block_size} tokens, the run's are {bs}; "
                "hash-id records with different block sizes cannot share one cache"
            )
        chain = self.builder.chain(req, with_output=self.config.store_output)
        prompt = chain.hashes[: chain.prompt_blocks]
        # the whole prompt's chain names the shard (the lookup below sees fewer blocks): its push goes there
        shard = self.shards.shard_of_chain(prompt) if self.sharded else 0
        idx = self.shard_indexes[shard]
        self.shard_lookups[shard] += 1
        # prefill looks up only blocks ending before the last prompt token (it must compute at least one
        # token for the logits): blocks [0, cap). The block after them is probed without a touch, only
        # to report the Mooncake-style prefix hit over all prompt blocks.
        cap = min((req.input_length - 1) // bs, len(prompt)) if req.input_length else 0
        # the fetch of the usable prefix is the only read that refreshes recency (as on the master, where
        # prefill acquires [0, p) + the checkpoint; probes do not touch; the puts below refresh the rest)
        m = idx.match_prefix(prompt[:cap], require_checkpoint=self.spec.hybrid, touch=True)
        run, usable = m.mla_run_blocks, m.usable_blocks
        full_run = run
        if run == cap:
            while full_run < len(prompt) and b"M" + prompt[full_run] in idx:
                full_run += 1
        owner = self._owner(req)
        cnt = self.owners[owner]
        usable_tokens = cnt.add_lookup(req, chain, full_run, run, usable)
        ssd_bytes = 0
        if self.config.ssd_capacity:
            ssd_tokens, ssd_bytes = self._read_tiers(shard, m, chain.block_tokens)
            cnt.ssd_cached_tokens += ssd_tokens
            cnt.ssd_bytes_read += ssd_bytes
        loaded = usable_tokens * self.spec.mla_bytes_per_token
        if usable and self.spec.hybrid:
            loaded += self.spec.kda_bytes_per_checkpoint
        hinted = self.config.hints
        for column, value in zip(
            self.per_req_columns,
            (
                req.workload,
                req.arrival_ms,
                req.input_length,
                usable_tokens,
                req.output_length,
                loaded - ssd_bytes,  # dram_bytes
                ssd_bytes,
                # what the bill prices the written tokens at: the request's own tiers, when they are honoured
                req.retention_tier if hinted else None,  # write_tier
                req.retained_prefix_tokens if hinted else 0,  # prefix_tokens
                req.prefix_retention_tier if hinted else None,  # prefix_tier
            ),
            strict=True,
        ):
            column.append(value)
        return _Store(req, chain, run, usable, m.checkpoint_blocks, owner, shard)

    def _read_tiers(self, shard: int, m: Any, sizes: list[int]) -> tuple[int, int]:
        """Tokens and bytes of the usable prefix that come off SSD; each such object is promoted to DRAM,
        as the store does on a real hit."""
        idx, real = self.shard_indexes[shard], self.slot_bytes[shard]
        tokens = read = 0
        keys = [*m.mla_keys, *([m.checkpoint_key] if m.checkpoint_key else [])]
        for j, (key, slot) in enumerate(zip(keys, m.slots, strict=True)):
            info = idx.get(key)
            if info is None or info.tier != Tier.SSD:
                continue
            read += real[slot]
            if j < m.usable_blocks:  # an MLA block (the checkpoint comes last)
                tokens += sizes[j]
            idx.promote(key)
        return tokens, read

    def store(self, st: _Store) -> None:
        """Write the request's objects: the whole prompt (and the reply's blocks), then checkpoints; what
        exists is refreshed, not written again (the master answers EXISTS and refreshes it)."""
        idx, spec, req, chain = self.shard_indexes[st.shard], self.spec, st.req, st.chain
        positions: list[int] = []
        # a client's retention hint covers prefill's puts (any span) and decode's (a whole-prompt one):
        # admission control does not turn them away, the pin that follows decides how long they stay
        hinted = self.config.hints
        by_prefill = hinted and bool(req.retention_ms or req.prefix_retention_ms)
        by_decode = hinted and bool(req.retention_ms)
        # every put of the request, in order (parent = previous block): the index skips what exists
        n, total = chain.prompt_blocks, len(chain.hashes)
        tokens, per_token = chain.block_tokens, spec.mla_bytes_per_token
        sizes = [1] * total if self.in_blocks else [t * per_token for t in tokens]  # its size in the index
        admits = [not by_prefill] * n + [not by_decode] * (total - n)
        checkpoints: list[tuple[int, int, bool]] = []
        if spec.hybrid:
            ck = self.config.checkpoints
            with_output = ck.end_of_output and self.config.store_output and req.output_tokens is not None
            positions = checkpoint_positions(
                ck, with_output, req.input_length, self.block_size, chain, st.run, st.usable
            )
            if self.config.hints and req.prefix_retention_ms:
                # a retained prefix (a cache_control breakpoint) is where the client will come back:
                # prefill writes a checkpoint there when it computes that boundary
                mark = req.retained_prefix_tokens // self.block_size
                if st.usable < mark <= chain.full_prompt_blocks and mark not in positions:
                    positions = sorted([*positions, mark])
            for c in positions:
                admit = not (by_decode if c > chain.full_prompt_blocks else by_prefill)
                checkpoints.append((c, self.kda_size, admit))
        try:
            answers = idx.insert_chain(
                chain.hashes, sizes, admits, checkpoints, node_id=NODE, tenant=req.tenant
            )
        except StoreIndexError as e:
            raise ReplayError(f"request {req.request_id}: the index refused an object ({e})") from e
        owner, cnt = st.owner, self.owners[st.owner]
        slot_owner, slot_bytes = self.slot_owner[st.shard], self.slot_bytes[st.shard]
        if len(slot_owner) < idx.allocated_slots:  # as the index's columns grow
            grow = idx.allocated_slots - len(slot_owner)
            slot_owner.frombytes(bytes(4 * grow))
            slot_bytes.frombytes(bytes(8 * grow))
        kda_bytes = spec.kda_bytes_per_checkpoint
        mla_written = checkpoints_written = objects = 0
        for i, slot in enumerate(answers):
            if slot < 0:
                if slot == -PUT_NOT_ADMITTED:
                    self.not_admitted += 1
                elif slot == -PUT_NO_ROOM:
                    self.refused += 1
                continue
            objects += 1
            slot_owner[slot] = owner
            if i < total:
                slot_bytes[slot] = real = tokens[i] * per_token
                mla_written += real
            else:
                slot_bytes[slot] = kda_bytes
                checkpoints_written += 1
        self.objects_written += objects
        cnt.mla_bytes_written += mla_written
        cnt.kda_bytes_written += checkpoints_written * kda_bytes
        cnt.checkpoints_written += checkpoints_written
        self.shard_bytes_written[st.shard] += mla_written + checkpoints_written * kda_bytes
        if self.config.hints and req.has_hints:
            self._honour_hints(idx, st, [MLA_TAG + h for h in chain.hashes], positions)

    def settle(self) -> tuple[int, int, int]:
        """What evictions took, settled once (the index emits no events here): per pair, the bytes it wrote
        minus the bytes of its objects still held, whoever caused the eviction. Returns the bytes still held,
        the bytes evicted and the objects evicted (nothing leaves the index here but by eviction: the
        simulator never removes, expires or loses a node)."""
        held_total = held_objects = 0
        held = np.zeros(len(self.owners), dtype=np.int64)
        for idx, owners, real in zip(self.shard_indexes, self.slot_owner, self.slot_bytes, strict=True):
            live = idx.committed_slots()
            if len(live):
                np.add.at(
                    held,
                    np.frombuffer(owners, dtype=np.int32)[live],
                    np.frombuffer(real, dtype=np.int64)[live],
                )
            held_objects += len(live)
        bytes_evicted = 0
        for o, cnt in enumerate(self.owners):
            cnt.bytes_evicted = cnt.mla_bytes_written + cnt.kda_bytes_written - int(held[o])
            bytes_evicted += cnt.bytes_evicted
            held_total += int(held[o])
        return held_total, bytes_evicted, self.objects_written - held_objects

    def _honour_hints(
        self, idx: PrefixIndex, st: _Store, mla_keys: list[bytes], positions: list[int]
    ) -> None:
        """Pin what the request asked to retain, then end its session if it was the last turn. A refused
        pin (over the budget) is counted, never an error: the request was served either way.

        The calls the serving path makes (``worker/store_push.retain_prefixes``), under the client's
        session (a hint without a ``cache_key`` gets the request's own): prefill pins each span (the
        retained prefix, the whole prompt) up to the deepest checkpoint at or before its end among the
        ones it wrote and the ones its lookup found, spans that end at the same checkpoint as one pin at
        the longest TTL; then decode pins the chain its end-of-output checkpoint closes, when it wrote one.
        The master pins a chain whole or not at all (``_pin``): where a key is gone, prefill tries the next
        shallower checkpoint once. Every turn's pins stay until their TTL or the session's end, and a
        prefix that several sessions pin stays pinned while any holds it. With ``SimConfig.supersede`` a
        session (a ``cache_key``) holds only its *latest* chain: a turn's pin releases the previous chain
        where the new one does not cover it (prefixes excepted).
        """
        req, chain, hybrid = st.req, st.chain, self.spec.hybrid
        session = req.cache_key or f"request:{req.request_id}"
        held = None
        if self.config.supersede and req.cache_key is not None:
            held = self.session_pins.setdefault((id(idx), req.tenant, session), _SessionPins())
        # prefill's candidates: the prompt's checkpoints it wrote (decode's end-of-output one is not) and
        # the ones its lookup found; a pure-MLA chain needs none (its span is its blocks)
        whole = chain.full_prompt_blocks
        have = sorted({c for c in positions if c <= whole}.union(st.existing), reverse=True) if hybrid else []
        merged: dict[int, tuple[int, bool, bool]] = {}  # checkpoint -> TTL, a prefix's, the whole prompt's
        for upto, ttl_ms, prefix in (
            (req.retained_prefix_tokens // self.block_size, req.prefix_retention_ms, True),
            (whole, req.retention_ms, False),
        ):
            k = next((c for c in have if c <= upto), 0) if hybrid else min(upto, len(mla_keys))
            if k and ttl_ms:
                other_ttl, other_prefix, other_whole = merged.get(k, (0, False, False))
                merged[k] = (max(ttl_ms, other_ttl), prefix or other_prefix, not prefix or other_whole)
        kept: set[bytes] = set()
        for k, (ttl_ms, prefix, whole_prompt) in merged.items():
            tries = [c for c in have if c <= k][:2] if hybrid else [k]  # asked for, then one shallower
            keys = self._retain(idx, mla_keys, tries, ttl_ms, session)
            if held is not None and prefix:
                held.prefix.update(keys)
            if whole_prompt:  # a merged pin is both: the next turn's chain must not release it
                kept.update(keys)
        end = len(chain.hashes)
        # decode pins only when it wrote the end-of-output checkpoint (nothing to try shallower)
        wrote_end = not hybrid or (end in positions and b"K" + chain.hashes[end - 1] in idx)
        if req.retention_ms and end > chain.prompt_blocks and wrote_end:
            kept.update(self._retain(idx, mla_keys, [end], req.retention_ms, session))
        if held is not None and kept:
            stale = [k for k in held.chain if k not in held.prefix and k not in kept]
            held.chain = kept
            if stale:
                idx.pin(stale, 0, session=session)
        if req.session_end and req.cache_key is not None:
            t = self.hints
            t.sessions_ended += 1
            # a session's chains may sit on several master shards (a prefix routes them): end it on each
            for shard in self.shard_indexes:
                t.objects_released += shard.end_session(req.tenant, req.cache_key)
                self.session_pins.pop((id(shard), req.tenant, session), None)

    def _retain(
        self, idx: PrefixIndex, mla_keys: list[bytes], candidates: list[int], ttl_ms: int, session: str
    ) -> list[bytes]:
        """One span of ``retain_prefixes``: pin blocks [0, c) and the checkpoint at c (a pure-MLA chain:
        the blocks alone) for the first candidate c the master answers, pinned or refused; a chain it
        answers neither (a key not in the index) passes to the next candidate. The keys pinned, or []."""
        for c in candidates:
            keys = mla_keys[:c]
            if self.spec.hybrid:
                keys.append(b"K" + mla_keys[c - 1][1:])
            pinned = self._pin(idx, keys, ttl_ms, session)
            if pinned is not None:
                return keys if pinned else []
        return []

    def _pin(self, idx: PrefixIndex, keys: list[bytes], ttl_ms: int, session: str) -> bool | None:
        """One pin call, counted, answered as the master answers a client's (``kvstore/master/core.py``
        ``pin``): a session's chain is pinned whole or not at all, so a key not in the index pins nothing
        and is no refusal (None); False when the index's budget refused it; True when pinned."""
        t = self.hints
        t.pins += 1
        if not all(k in idx for k in keys):
            t.pins_incomplete += 1
            return None
        pinned = idx.pin(keys, ttl_ms, session=session)
        if not pinned:
            t.pins_refused += 1
            return False
        t.objects_pinned += pinned
        return True


def simulate(
    requests: Iterable[Request],
    config: SimConfig,
    progress: Callable[[int, int], None] | None = None,
    visibility_delays_ms: Sequence[float] | None = None,
    chains: ChainBuilder | None = None,
) -> SimResult:
    """Replay ``requests`` through a fresh ``PrefixIndex``: a list is sorted by arrival here (stable); any
    other iterable is streamed in arrival order through a bounded reorder window (see the module docstring;
    progress then reports requests done over requests read so far).

    With ``config.visibility_delay_ms`` > 0 a request's objects become visible that long after its
    arrival (a stand-in for prefill + decode time), so requests arriving meanwhile miss them, as live.
    ``visibility_delays_ms`` (one per request of a list, in the order given) overrides it per request, e.g.
    with each request's measured TTFT from a live replay (prefill has pushed by its first token).
    ``chains``: a builder that has seen these requests (``chains.warmed_builder``), shared by the points of
    a sweep so that each does not hash the trace again; the hashes, and so the result, are the same.
    """
    stream, total, sized = _arrivals(requests, config, visibility_delays_ms)
    block_size = effective_block_size(sized, config.spec, config.block_size)
    oracle = None
    if config.policy in YARDSTICKS:
        if not isinstance(requests, Sequence):
            raise ReplayError(f"policy {config.policy!r} reads the future: it needs the requests as a list")
        oracle = ReuseOracle(requests, config.spec.name, block_size)
    r = _Replay(config, block_size, oracle, chains)
    pending: list[tuple[float, int, _Store]] = []  # (visible at, sequence, store)
    lo = hi = None
    for seq, (req, delay_ms) in enumerate(stream):
        now = req.arrival_ms / 1000.0 + seq * 1e-6
        lo = req.arrival_ms if lo is None else lo
        hi = req.arrival_ms
        while pending and pending[0][0] <= now:
            r.clock.now, _, st = heapq.heappop(pending)
            r.store(st)
        r.clock.now = now
        st = r.lookup(req)
        if delay_ms > 0:
            heapq.heappush(pending, (now + delay_ms / 1000.0, seq, st))
        else:
            r.store(st)
        if progress is not None:
            progress(seq + 1, total or seq + 1)
    while pending:
        r.clock.now, _, st = heapq.heappop(pending)
        r.store(st)
    bytes_held, bytes_evicted, objects_evicted = r.settle()
    per_workload: dict[str, Counters] = {}
    per_tenant: dict[str, Counters] = {}
    totals = Counters()
    for (workload, tenant), cnt in zip(r.owner_ids, r.owners, strict=True):  # ids in creation order
        for group, name in ((per_workload, workload), (per_tenant, tenant)):
            group.setdefault(name, Counters()).add(cnt)
        totals.add(cnt)
    return SimResult(
        config=config,
        total=totals,
        per_workload=per_workload,
        per_tenant=per_tenant,
        bytes_evicted=bytes_evicted,
        objects_evicted=objects_evicted,
        objects_refused=r.refused,
        objects_demoted=sum(idx.stats().demotions for idx in r.shard_indexes),
        objects_not_admitted=r.not_admitted,
        block_size=r.block_size,
        bytes_held=bytes_held,
        capacity_bytes=r.capacity_bytes,
        duration_s=(hi - lo) / 1000.0 if lo is not None and hi is not None else 0.0,
        per_request=r.per_req,
        shard_lookups=r.shard_lookups,
        shard_bytes_written=r.shard_bytes_written,
        hints=r.hints.to_dict(),
        pinned_bytes=sum(idx.stats().pinned_bytes for idx in r.shard_indexes) if r.hints.pins else 0,
        pin_budget_earned=min(idx.pin_budget.earned for idx in r.shard_indexes),
    )


def _arrivals(
    requests: Iterable[Request], config: SimConfig, delays: Sequence[float] | None
) -> tuple[Iterator[tuple[Request, float]], int, Sequence[Request]]:
    """(request, visibility delay ms) in arrival order, the count when known (0 for a stream), and the
    requests that size the blocks: all of a list, the first of a stream."""
    if not isinstance(requests, Sequence):
        if delays is not None:
            raise ReplayError("per-request visibility delays need the requests as a list, not a stream")
        ordered = arrival_ordered(requests, trace.REORDER_WINDOW)
        first = next(ordered, None)
        head = [] if first is None else [first]
        it = ((q, config.visibility_delay_ms) for q in itertools.chain(head, ordered))
        return it, 0, head
    if delays is not None:
        if len(delays) != len(requests):
            raise ReplayError(f"{len(delays)} visibility delays for {len(requests)} requests")
        if not all(math.isfinite(d) and d >= 0 for d in delays):
            raise ReplayError("visibility delays must be finite and >= 0 ms")
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_ms)
    it = ((requests[i], config.visibility_delay_ms if delays is None else delays[i]) for i in order)
    return it, len(requests), requests


def effective_block_size(requests: Sequence[Request], spec: ModelSpec, block_size: int | None) -> int:
    """Token records are cut into ``block_size`` (default: the spec's) blocks; id-only records bring
    their own block size (512 for Mooncake), which then sizes blocks and capacity units for the run."""
    id_sizes = {r.block_size for r in requests if r.tokens is None}
    if len(id_sizes) > 1:
        raise ReplayError(f"hash-id records with block sizes {sorted(id_sizes)} cannot share one cache")
    if id_sizes:
        (ids,) = id_sizes
        if block_size is not None and block_size != ids:
            raise ReplayError(f"the trace's blocks are {ids} tokens; --block-size {block_size} cannot apply")
        return ids
    return block_size or spec.default_block_size
