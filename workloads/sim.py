"""Simulated replay: requests through the master's own ``PrefixIndex`` + eviction, no model compute.

Per request, in arrival order (index clock = arrival seconds + 1 µs x sequence number, so every request
has its own instant even when a trace stamps many with the same millisecond):

1. **Lookup**: ``match_prefix`` over the prompt's block chain (joint rule for a hybrid spec: MLA blocks
   [0, p) plus a KDA checkpoint closing block p-1; plain MLA run for a pure-MLA spec).
2. **Count**: the MLA run (the Mooncake "prefix hit": a block counts only if every earlier block of the
   request hit), the usable prefix p (what prefill may skip, what ``cached_tokens`` reports), and the
   tokens lost between them to a missing checkpoint.
3. **Store**: the whole prompt is stored: missing blocks are inserted in prefix order (parent = previous
   block); present ones are left alone, as the master answers EXISTS to a duplicate put without touching.
   Recency is refreshed only by the fetch of the usable prefix (``match_prefix(touch=True)``, what
   prefill's acquire does) and by inserts. With ``store_output`` and token records
   that carry ``output_tokens``, the blocks the reply closes are stored too (decode pushes them).
4. **Checkpoints** (``CheckpointPolicy``), only at boundaries the request computes itself (c > p):
   end of prompt (last full prompt block), end of output, junction (c = MLA run when the run passed the
   last checkpoint), every N blocks.

Capacity is bytes from the spec (MLA block = tokens x MLA bytes/token, checkpoint = KDA bytes) or
"blocks": every MLA object is one unit and a checkpoint weighs ceil(KDA bytes / full MLA block bytes)
units. Eviction (policy, watermarks, leaf-first) is entirely the index's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.kvstore.eviction import POLICIES
from kvpool.kvstore.index import CapacityError, ObjectKind, PrefixIndex, StoreIndexError
from kvpool.prefill.policy import CheckpointPolicy as PrefillCheckpointPolicy
from kvpool.workloads.chains import Chain, ChainBuilder
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.specs import ModelSpec
from kvpool.workloads.trace import Request

INFINITE = 1 << 62
NODE = "sim"


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """Where KDA checkpoints are written (design §3): the prompt-side rules are the prefill's own
    :class:`kvpool.prefill.policy.CheckpointPolicy` (end of prompt, junction, every N blocks), the output
    rule is the decode engine's end-of-output checkpoint. ``interval_blocks`` 0 disables the interval."""

    end_of_prompt: bool = True
    end_of_output: bool = True
    junctions: bool = True
    interval_blocks: int = 0

    @classmethod
    def parse(cls, text: str) -> CheckpointPolicy:
        """``"prompt,output,junction,every=16"``, any subset (``end`` = ``prompt``, the workers' spelling);
        ``"none"`` for no checkpoints at all."""
        flags = {"prompt": False, "output": False, "junction": False}
        interval = 0
        for part in filter(None, (p.strip() for p in text.split(","))):
            if part == "none":
                continue
            if part.startswith("every="):
                try:
                    interval = int(part[6:])
                except ValueError:
                    raise ReplayError(f"bad checkpoint interval {part!r}") from None
                if interval <= 0:
                    raise ReplayError("checkpoint interval must be a positive number of blocks")
            elif part in flags or part == "end":
                flags["prompt" if part == "end" else part] = True
            else:
                raise ReplayError(
                    f"unknown checkpoint policy part {part!r}; use prompt, output, junction, every=N or none"
                )
        return cls(flags["prompt"], flags["output"], flags["junction"], interval)

    @property
    def label(self) -> str:
        parts = [
            n
            for n, on in (
                ("prompt", self.end_of_prompt),
                ("output", self.end_of_output),
                ("junction", self.junctions),
            )
            if on
        ]
        if self.interval_blocks:
            parts.append(f"every={self.interval_blocks}")
        return ",".join(parts) or "none"

    def prefill_policy(self) -> PrefillCheckpointPolicy:
        """The prefill engine's policy object with the same prompt-side switches."""
        return PrefillCheckpointPolicy(self.end_of_prompt, self.junctions, self.interval_blocks)


@dataclass(frozen=True, slots=True)
class SimConfig:
    spec: ModelSpec
    policy: str = "lru"
    capacity: int | None = None  # None: unbounded
    capacity_unit: str = "bytes"  # or "blocks"
    block_size: int | None = None  # for token records; default the spec's
    checkpoints: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    store_output: bool = True

    def check(self) -> None:
        if self.policy not in POLICIES:
            raise ReplayError(f"unknown eviction policy {self.policy!r}; choose one of {sorted(POLICIES)}")
        if self.capacity_unit not in ("bytes", "blocks"):
            raise ReplayError("capacity unit must be 'bytes' or 'blocks'")
        if self.capacity is not None and (type(self.capacity) is not int or self.capacity <= 0):
            raise ReplayError(f"capacity must be a positive integer, got {self.capacity!r}")
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ReplayError("need 0 < low watermark <= high watermark <= 1")
        bs = self.block_size or self.spec.default_block_size
        if bs <= 0 or bs % 64:
            raise ReplayError(f"block size must be a positive multiple of 64, got {bs}")


@dataclass(slots=True)
class Counters:
    """Additive tallies for one workload (or the total)."""

    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    input_blocks: int = 0
    hit_blocks: int = 0  # MLA prefix run (Mooncake rule)
    usable_blocks: int = 0
    mla_hit_tokens: int = 0
    cached_tokens: int = 0  # usable prefix tokens (joint rule)
    lost_tokens: int = 0  # MLA-run tokens unusable for lack of a checkpoint
    mla_bytes_written: int = 0
    kda_bytes_written: int = 0
    checkpoints_written: int = 0
    bytes_evicted: int = 0  # of objects this workload / tenant wrote, whoever caused the eviction

    def add(self, other: Counters) -> None:
        for name in self.__slots__:  # type: ignore[attr-defined]
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_dict(self) -> dict[str, Any]:
        d = {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]
        d["block_hit_rate"] = self.hit_blocks / self.input_blocks if self.input_blocks else 0.0
        d["usable_block_hit_rate"] = self.usable_blocks / self.input_blocks if self.input_blocks else 0.0
        d["token_hit_rate"] = self.cached_tokens / self.input_tokens if self.input_tokens else 0.0
        d["mla_token_hit_rate"] = self.mla_hit_tokens / self.input_tokens if self.input_tokens else 0.0
        d["lost_token_fraction"] = self.lost_tokens / self.input_tokens if self.input_tokens else 0.0
        return d


@dataclass(slots=True)
class SimResult:
    config: SimConfig
    total: Counters
    per_workload: dict[str, Counters]
    per_tenant: dict[str, Counters]
    bytes_evicted: int
    objects_evicted: int
    objects_refused: int  # larger than the whole capacity, or the pool is full of pinned objects
    block_size: int  # tokens per block actually used
    bytes_held: int
    capacity_bytes: int | None
    duration_s: float  # trace time spanned (first to last arrival)
    per_request: dict[str, list[Any]]  # workload, arrival_ms, input, cached, output

    def to_dict(self, per_request: bool = False) -> dict[str, Any]:
        c = self.config
        out: dict[str, Any] = {
            "requests": self.total.requests,
            **self.total.to_dict(),
            "bytes_evicted": self.bytes_evicted,
            "objects_evicted": self.objects_evicted,
            "objects_refused": self.objects_refused,
            "bytes_held": self.bytes_held,
            "capacity_bytes": self.capacity_bytes,
            "duration_s": self.duration_s,
            "config": {
                "spec": c.spec.name,
                "policy": c.policy,
                "capacity": c.capacity,
                "capacity_unit": c.capacity_unit,
                "block_size": self.block_size,
                "checkpoints": c.checkpoints.label,
                "hybrid": c.spec.hybrid,
                "high_watermark": c.high_watermark,
                "low_watermark": c.low_watermark,
            },
            "workloads": {w: s.to_dict() for w, s in sorted(self.per_workload.items())},
            "tenants": {t: s.to_dict() for t, s in sorted(self.per_tenant.items())},
        }
        if per_request:
            out["per_request"] = self.per_request
        return out


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(
    requests: Sequence[Request],
    config: SimConfig,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Replay ``requests`` (sorted by arrival here, stable) through a fresh ``PrefixIndex``."""
    config.check()
    spec = config.spec
    block_size = effective_block_size(requests, spec, config.block_size)
    full_block_bytes = spec.mla_bytes_per_token * block_size
    if config.capacity_unit == "blocks":
        kda_size = math.ceil(spec.kda_bytes_per_checkpoint / full_block_bytes) if spec.hybrid else 0
        capacity_bytes = None if config.capacity is None else config.capacity * full_block_bytes
    else:
        kda_size = spec.kda_bytes_per_checkpoint
        capacity_bytes = config.capacity
    clock = _Clock()
    idx = PrefixIndex(
        config.policy,
        high_watermark=config.high_watermark,
        low_watermark=config.low_watermark,
        clock=clock,
        keep_events=True,
    )
    idx.add_node(NODE, config.capacity if config.capacity is not None else INFINITE)
    builder = ChainBuilder(spec.name, block_size)
    ck = config.checkpoints
    prefill_policy = ck.prefill_policy()
    hybrid = spec.hybrid
    in_blocks = config.capacity_unit == "blocks"
    per_workload: dict[str, Counters] = {}
    per_tenant: dict[str, Counters] = {}
    real_size: dict[bytes, int] = {}
    owner: dict[bytes, tuple[Counters, Counters]] = {}  # object -> (its workload's, its tenant's) counters
    bytes_evicted = objects_evicted = refused = 0
    per_req: dict[str, list[Any]] = {k: [] for k in ("workload", "arrival_ms", "input", "cached", "output")}
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_ms)
    mla, kda = ObjectKind.MLA, ObjectKind.KDA
    total_n = len(order)
    for seq, i in enumerate(order):
        req = requests[i]
        clock.now = req.arrival_ms / 1000.0 + seq * 1e-6
        chain = builder.chain(req, with_output=config.store_output)
        prompt = chain.hashes[: chain.prompt_blocks]
        # prefill looks up only blocks ending before the last prompt token (it must compute at least one
        # token for the logits): blocks [0, cap). The block after them is probed without a touch, only
        # to report the Mooncake-style prefix hit over all prompt blocks.
        cap = min((req.input_length - 1) // block_size, len(prompt)) if req.input_length else 0
        # the fetch of the usable prefix is the only read that refreshes recency (as on the master, where
        # prefill acquires [0, p) + the checkpoint; probes and "already exists" puts do not touch)
        m = idx.match_prefix(prompt[:cap], require_checkpoint=hybrid, touch=True)
        run, usable = m.mla_run_blocks, m.usable_blocks
        full_run = run
        if run == cap:
            while full_run < len(prompt) and b"M" + prompt[full_run] in idx:
                full_run += 1
        cnt = Counters()  # this request; added to its workload and tenant at the end
        sizes = chain.block_tokens
        run_tokens = sum(sizes[:run])
        usable_tokens = sum(sizes[:usable])
        full_run_tokens = sum(sizes[:full_run])
        cnt.requests += 1
        cnt.input_tokens += req.input_length
        cnt.output_tokens += req.output_length
        cnt.input_blocks += chain.prompt_blocks
        cnt.hit_blocks += full_run
        cnt.usable_blocks += usable
        cnt.mla_hit_tokens += full_run_tokens
        cnt.cached_tokens += usable_tokens
        cnt.lost_tokens += run_tokens - usable_tokens
        per_req["workload"].append(req.workload)
        per_req["arrival_ms"].append(req.arrival_ms)
        per_req["input"].append(req.input_length)
        per_req["cached"].append(usable_tokens)
        per_req["output"].append(req.output_length)
        # store the whole prompt (and the reply's blocks): what exists stays as it is, the rest is inserted
        keys = [b"M" + h for h in chain.hashes]
        new_keys: list[bytes] = []
        try:
            for j, key in enumerate(keys):
                if key in idx:
                    continue
                real = sizes[j] * spec.mla_bytes_per_token
                parent = keys[j - 1] if j else b""
                if not _insert(idx, key, mla, 1 if in_blocks else real, req.tenant, parent):
                    refused += 1
                    continue
                real_size[key] = real
                new_keys.append(key)
                cnt.mla_bytes_written += real
            if hybrid:
                for c in _checkpoint_positions(
                    prefill_policy,
                    ck.end_of_output and config.store_output and req.output_tokens is not None,
                    req.input_length,
                    block_size,
                    chain,
                    run,
                    usable,
                ):
                    key = b"K" + chain.hashes[c - 1]
                    if key in idx:
                        continue
                    if not _insert(idx, key, kda, kda_size, req.tenant, b""):
                        refused += 1
                        continue
                    real_size[key] = spec.kda_bytes_per_checkpoint
                    new_keys.append(key)
                    cnt.kda_bytes_written += spec.kda_bytes_per_checkpoint
                    cnt.checkpoints_written += 1
        except StoreIndexError as e:
            raise ReplayError(f"request {req.request_id}: the index refused an object ({e})") from e
        groups = []
        for group, name in ((per_workload, req.workload), (per_tenant, req.tenant)):
            into = group.get(name)
            if into is None:
                into = group[name] = Counters()
            into.add(cnt)
            groups.append(into)
        mine = (groups[0], groups[1])
        for key in new_keys:
            owner[key] = mine
        for ev in idx.drain_events():
            size = real_size.pop(ev.key, 0)
            objects_evicted += 1
            bytes_evicted += size
            for into in owner.pop(ev.key, ()):
                into.bytes_evicted += size
        if progress is not None:
            progress(seq + 1, total_n)
    total = Counters()
    for c in per_workload.values():
        total.add(c)
    assert total.bytes_evicted == bytes_evicted
    arrivals = [r.arrival_ms for r in requests]
    duration = (max(arrivals) - min(arrivals)) / 1000.0 if arrivals else 0.0
    return SimResult(
        config=config,
        total=total,
        per_workload=per_workload,
        per_tenant=per_tenant,
        bytes_evicted=bytes_evicted,
        objects_evicted=objects_evicted,
        objects_refused=refused,
        block_size=block_size,
        bytes_held=sum(real_size.values()),
        capacity_bytes=capacity_bytes,
        duration_s=duration,
        per_request=per_req,
    )


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


def _insert(idx: PrefixIndex, key: bytes, kind: ObjectKind, size: int, tenant: str, parent: bytes) -> bool:
    """Insert, or report False when the index cannot hold the object (as a master's put would fail: the
    request still runs, the object is simply not cached)."""
    try:
        idx.insert(key, kind, size, node_id=NODE, tenant=tenant, parent=parent)
    except CapacityError:
        return False
    return True


def _checkpoint_positions(
    prefill_policy: PrefillCheckpointPolicy,
    end_of_output: bool,
    prompt_len: int,
    bs: int,
    chain: Chain,
    run: int,
    usable: int,
) -> list[int]:
    """Block counts c (checkpoint keyed by h_{c-1}) this request writes, ascending: the prefill's own
    boundaries over (usable, last full prompt block], then decode's end-of-output snapshot (the last block
    boundary crossed while decoding, i.e. the last block of prompt + reply[:-1], if past the prompt's)."""
    out = [
        b // bs
        for b in prefill_policy.boundaries(
            prompt_len=prompt_len,
            block_size=bs,
            start_blocks=usable,
            mla_run_blocks=min(run, chain.full_prompt_blocks),
        )
    ]
    total = len(chain.hashes)
    if end_of_output and total > chain.prompt_blocks and total > usable:
        out.append(total)
    return out
