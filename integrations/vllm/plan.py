"""Scheduler-side bookkeeping: which store objects move where, per request and per engine step.

Pure (no vLLM import): the connector feeds it block ids and token counts from vLLM's scheduler output and
ships the resulting ``StepPlan`` to its workers. Two kinds of objects (``docs/design/vllm_connector.md``):

* a **chunk object** per full prompt chunk: the chunk's vLLM blocks of every attention group, keyed like
  kvpool's MLA blocks (``mla_key(h_k)``, parent ``mla_key(h_{k-1})``);
* a **state object** at a chunk boundary: the recurrent-state blocks of every state (Mamba-type) group at
  that position, keyed like kvpool's KDA checkpoints (``kda_key(h_{n-1})``).

A hybrid prefix is usable only up to the last stored state (the store's joint rule, answered by
``match_prefix(require_checkpoint=True)``), never past it: MLA-style chunks past the last state are
useless to a model that must resume its recurrent layers there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvpool.cache.hashing import BlockHash
from kvpool.integrations.vllm.chunks import GroupLayout
from kvpool.kvstore.keys import kda_key, mla_key
from kvpool.proto import common_pb2

NULL_BLOCK = 0  # vLLM's block pool reserves block 0 as the null block (a slot that holds nothing)


@dataclass(frozen=True, slots=True)
class Transfer:
    """One store object and where its bytes live in vLLM's paged buffers: ``blocks[i]`` are the block ids of
    group ``groups[i]``, in token order."""

    key: bytes
    kind: int  # common_pb2.MLA_BLOCK (chunk object) or common_pb2.KDA_CHECKPOINT (state object)
    parent: bytes
    chunk_index: int  # chunk objects: k; state objects: n - 1 for the state after n chunks
    groups: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    skip: tuple[int, ...] = ()  # loads: leading blocks per group left alone (the engine computed them)
    route: bytes = b""  # master shards: the request's chain route (every object of a request goes there)
    # loads: where the scheduler's lookup found it, a serialized common_pb2.ObjectLocation (plans are
    # pickled to the workers, and generated protobuf classes do not pickle under our package mapping)
    location: bytes = b""

    @property
    def skips(self) -> tuple[int, ...]:
        """Per group, how many leading blocks a load leaves alone (none unless ``skip`` says so)."""
        return self.skip or (0,) * len(self.blocks)

    def written(self) -> list[tuple[int, ...]]:
        """Per group, the block ids a load writes (all of them but the skipped leading ones)."""
        return [ids[s:] for ids, s in zip(self.blocks, self.skips, strict=True)]


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """A request's external hit: its transfers in chain order (a failure fails every later one too) and the
    first token position to write (blocks before it are the engine's own, possibly shared: left alone).

    ``asynchronous``: vLLM was told the load finishes later (the request waits in WAITING_FOR_REMOTE_KVS
    while the engine steps others); ``unloadable``: blocks vLLM allocated for a hit the planner could not
    map to objects, reported as load errors so that vLLM recomputes them."""

    req_id: str
    transfers: tuple[Transfer, ...]
    write_from: int
    route: bytes = b""  # master shards: the request's chain route
    asynchronous: bool = False
    unloadable: tuple[int, ...] = ()


@dataclass(slots=True)
class StepPlan:
    """What the workers do in one engine step: loads before the forward pass, saves after it.

    ``idle``: the step runs no forward pass (no request has tokens scheduled), so the engine has nothing to
    do but wait for loads in flight: the worker waits for them there, with the GIL released, instead of
    returning at once into another empty step that competes for the GIL with the load's thread."""

    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    idle: bool = False


@dataclass(slots=True)
class RequestTracker:
    """What the scheduler side remembers of one running request."""

    req_id: str
    prompt_len: int
    hashes: list[BlockHash]  # one per full prompt chunk
    block_ids: list[list[int]]  # per group, as vLLM allocated them so far
    saved_chunks: int = 0  # chunks [0, saved_chunks) are in the store or already planned for a save
    saved_states: set[int] = field(default_factory=set)
    route: bytes = b""  # master shards: the route of the prompt's chunk chain (kvstore/shards.py)

    def add_blocks(self, new_block_ids: Sequence[Sequence[int]] | None, replace: bool = False) -> None:
        if new_block_ids is None:
            return
        if replace:
            self.block_ids = [list(b) for b in new_block_ids]
        else:
            for mine, new in zip(self.block_ids, new_block_ids, strict=True):
                mine.extend(new)


class Planner:
    """Turns a tracker's block ids and progress into transfers. ``groups`` are vLLM's KV-cache groups in
    order; attention groups move per chunk, state groups only at boundaries (``state_mode``: vLLM's
    ``mamba_cache_mode``: ``none`` keeps the running state in the request's first block, ``align``/``all``
    keep the state after block j in block j)."""

    def __init__(self, groups: Sequence[GroupLayout], chunk: int, state_mode: str = "align") -> None:
        self.groups = list(groups)
        self.chunk = chunk
        self.state_mode = state_mode
        self.attention = tuple(i for i, g in enumerate(self.groups) if g.attention)
        self.states = tuple(i for i, g in enumerate(self.groups) if not g.attention)

    @property
    def hybrid(self) -> bool:
        return bool(self.states)

    def chunk_transfer(self, t: RequestTracker, k: int) -> Transfer | None:
        """Chunk k's object, or None while vLLM has not allocated all of its blocks."""
        blocks = []
        for g in self.attention:
            per = self.chunk // self.groups[g].block_size
            ids = t.block_ids[g][k * per : (k + 1) * per]
            if len(ids) < per or NULL_BLOCK in ids:
                return None
            blocks.append(tuple(ids))
        parent = mla_key(t.hashes[k - 1]) if k > 0 else b""
        key = mla_key(t.hashes[k])
        return Transfer(key, common_pb2.MLA_BLOCK, parent, k, self.attention, tuple(blocks), route=t.route)

    def state_transfer(self, t: RequestTracker, n: int) -> Transfer | None:
        """The state object after n chunks, or None where vLLM keeps no state block for that position."""
        if not self.states or not 0 < n <= len(t.hashes):
            return None
        blocks = []
        for g in self.states:
            index = 0 if self.state_mode == "none" else n * self.chunk // self.groups[g].block_size - 1
            ids = t.block_ids[g]
            if index >= len(ids) or ids[index] == NULL_BLOCK:
                return None
            blocks.append((ids[index],))
        key = kda_key(t.hashes[n - 1])
        return Transfer(key, common_pb2.KDA_CHECKPOINT, b"", n - 1, self.states, tuple(blocks), route=t.route)

    def load(
        self,
        t: RequestTracker,
        start: int,
        end: int,
        located: Sequence[common_pb2.ObjectLocation] = (),
        state_located: common_pb2.ObjectLocation | None = None,
        asynchronous: bool = False,
    ) -> LoadPlan | None:
        """Load tokens [start, end) (end on a chunk boundary): the chunks that overlap them, then the state
        at ``end`` for a hybrid model, each with the location the scheduler's lookup gave for it
        (``located[k]`` for chunk k, ``state_located`` for the state). None if any block is missing (then
        nothing is loaded)."""
        transfers = []
        for k in range(start // self.chunk, end // self.chunk):
            tr = self.chunk_transfer(t, k)
            if tr is None:
                return None
            before = max(start - k * self.chunk, 0)
            skip = tuple(before // self.groups[g].block_size for g in tr.groups)
            where = located[k].SerializeToString() if k < len(located) else b""
            transfers.append(replace(tr, skip=skip, location=where))
        if self.hybrid:
            st = self.state_transfer(t, end // self.chunk)
            if st is None:
                return None
            where = state_located.SerializeToString() if state_located is not None else b""
            transfers.append(replace(st, location=where))
        return LoadPlan(t.req_id, tuple(transfers), start, route=t.route, asynchronous=asynchronous)

    def unloadable(self, t: RequestTracker, start: int) -> LoadPlan:
        """An asynchronous hit the planner cannot map (``load`` gave None): nothing is read, and every block
        vLLM allocated from token ``start`` on is reported for it to recompute."""
        ids = {
            b
            for g, layout in enumerate(self.groups)
            for b in t.block_ids[g][start // layout.block_size :]
            if b != NULL_BLOCK
        }
        return LoadPlan(t.req_id, (), start, route=t.route, asynchronous=True, unloadable=tuple(sorted(ids)))

    def saves_after(self, t: RequestTracker, computed: int) -> list[Transfer]:
        """Objects that become complete once ``computed`` tokens of the request are in vLLM's cache: full
        prompt chunks not saved yet, and (hybrid) the state when the step ends exactly on a boundary."""
        out: list[Transfer] = []
        full = min(computed, t.prompt_len) // self.chunk
        while t.saved_chunks < min(full, len(t.hashes)):
            tr = self.chunk_transfer(t, t.saved_chunks)
            if tr is None:
                break
            out.append(tr)
            t.saved_chunks += 1
        n = computed // self.chunk
        if self.hybrid and computed % self.chunk == 0 and n not in t.saved_states and n <= t.saved_chunks:
            st = self.state_transfer(t, n)
            if st is not None:
                out.append(st)
                t.saved_states.add(n)
        return out


def blocks_of(plan: LoadPlan, from_transfer: int = 0) -> set[int]:
    """Every vLLM block id the plan writes from its ``from_transfer``-th transfer on (load errors)."""
    return {b for tr in plan.transfers[from_transfer:] for ids in tr.written() for b in ids} | set(
        plan.unloadable
    )
