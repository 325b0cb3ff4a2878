"""KvEventRecorder: what one :class:`~kvpool.kvstore.master.core.MasterCore` tells the KV-event publisher.

The core calls it where its index changes in a way an outside router cares about (a block or checkpoint
committed, adopted, dropped, moved between tiers; the index started empty). The recorder turns each into a
compact tuple and hands the tuples of one event-loop pass to the publisher at the end of that pass (one
``loop.call_soon`` per pass), so the master's calls pay one list append per block and nothing else: the
events are built, coalesced and encoded on the publisher's thread (``kv_event_publisher``).

Item tuples (built here, read by :func:`items_to_events`):

* ``("S", group, hash, parent_hash | None, block_index | None, tier, tenant, token_ids | None)``
* ``("R", group, hash, tier)``
* ``("C",)`` (the index is empty: a new master life)

Only block objects are published (keys ``kvstore.keys.MLA_TAG/KDA_TAG`` + a 32-byte hash): tails and blobs
are request-scoped and no router can match them.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.kvstore.index.prefix_index import PrefixIndex
from kvpool.kvstore.index.records import Tier
from kvpool.kvstore.keys import MLA_TAG, block_tag
from kvpool.kvstore.protocol.kv_events_wire import (
    CLEARED_EVENT,
    GROUP_CHECKPOINT,
    GROUP_MLA,
    MEDIUM_CPU,
    MEDIUM_EXTERNAL,
    MEDIUM_STORAGE,
    HashFormat,
    external_hash,
    removed_event,
    stored_event,
)

Item = tuple[Any, ...]
CLEARED: Item = ("C",)
TIER_MEDIUM = {int(Tier.DRAM): MEDIUM_CPU, int(Tier.SSD): MEDIUM_STORAGE}


class KvEventRecorder:
    """Per core: turns index changes into items; ``submit(items)`` is called once per loop pass with them.

    ``shared_medium``: every object is ``EXTERNAL`` (one shared pool, as a consumer that models kvpool as a
    pool outside its engines sees it) and tier moves are not events; otherwise DRAM is ``CPU`` and SSD
    ``STORAGE`` and a demotion or promotion is a removal from one medium and a store on the other."""

    def __init__(
        self,
        index: PrefixIndex,
        submit: Callable[[list[Item]], None],
        loop: asyncio.AbstractEventLoop,
        *,
        shared_medium: bool = False,
        keep_tokens: bool = False,
        counters: Callable[[], dict[str, int]] = dict,
    ) -> None:
        self.index = index
        self.counters = counters  # the publisher's, for the core's Stats
        self._submit = submit
        self._loop = loop
        self.shared_medium = shared_medium
        # --kv-events-keep-tokens: every published MLA block's tokens, so snapshots and tier moves carry them
        # (consumers that rehash tokens, Dynamo, drop a block without). Costs 4 B per token per block.
        self._tokens: dict[bytes, array[int]] | None = {} if keep_tokens else None
        self._items: list[Item] = []
        self._moving = False
        self._scheduled = False

    def _add(self, item: Item) -> None:
        self._items.append(item)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Hand this pass's items to the publisher (scheduled by the first item of a pass)."""
        self._scheduled = False
        if self._items:
            items, self._items = self._items, []
            self._submit(items)

    def cleared(self) -> None:
        """The index is empty and its history does not count any more (a new core: restart, new leader)."""
        self._add(CLEARED)

    def stored(self, key: bytes, token_ids: Sequence[int] | None = None) -> None:
        """``key`` was committed (or adopted from a node's inventory): publish it if it is a block."""
        kept = self._tokens
        if kept is not None and token_ids and key[:1] == MLA_TAG:
            kept[key] = array("I", token_ids)
        item = self._stored_item(key, token_ids)
        if item is not None:
            self._add(item)

    def _stored_item(self, key: bytes, token_ids: Sequence[int] | None) -> Item | None:
        tag = block_tag(key)
        if tag is None:
            return None
        if token_ids is None and self._tokens is not None:
            token_ids = self._tokens.get(key)
        info = self.index.get(key)
        if info is None or not info.committed:
            return None
        if tag == MLA_TAG:
            group, parent = GROUP_MLA, info.parent
        else:  # a checkpoint: its chain position is its MLA block's, and so is its parent
            group = GROUP_CHECKPOINT
            block = self.index.get(MLA_TAG + key[1:])
            parent = block.parent if block is not None else b""
        parent_hash = parent[1:] if block_tag(parent) == MLA_TAG else None
        index = info.depth - 1 if info.depth else None
        return ("S", group, key[1:], parent_hash, index, int(info.tier), info.tenant, token_ids)

    def removed(self, key: bytes, tier: Tier | int) -> None:
        """``key`` left ``tier`` (evicted, expired, removed, lost with its node)."""
        tag = block_tag(key)
        if tag is not None:
            if self._tokens is not None and not self._moving:
                self._tokens.pop(key, None)
            self._add(("R", GROUP_MLA if tag == MLA_TAG else GROUP_CHECKPOINT, key[1:], int(tier)))

    def moved(self, key: bytes, from_tier: Tier | int) -> None:
        """``key`` changed tier (demoted to SSD, promoted to DRAM); it stays stored."""
        if self.shared_medium or block_tag(key) is None:
            return
        item = self._stored_item(key, None)
        if item is not None:
            self._moving = True
            try:
                self.removed(key, from_tier)
            finally:
                self._moving = False
            self._add(item)

    def snapshot_keys(self) -> list[bytes]:
        """The committed block keys now (the publisher's snapshot walks them a slice at a time)."""
        return [k for k in self.index if block_tag(k) is not None]

    def dump_items(self, keys: Sequence[bytes]) -> list[Item]:
        """Stored items of those of ``keys`` still committed (a few microseconds per key, on the loop)."""
        out = []
        for key in keys:
            item = self._stored_item(key, None)
            if item is not None:
                out.append(item)
        return out


def snapshot_order(items: list[Item]) -> list[Item]:
    """``AllBlocksCleared``, then the MLA blocks chain by chain, each parent before its children
    (depth-first from each root, so a run becomes one event and a consumer that needs parents first has
    them), then the checkpoints."""
    blocks = [it for it in items if it[1] == GROUP_MLA]
    checkpoints = [it for it in items if it[1] != GROUP_MLA]
    held = {it[2] for it in blocks}
    children: dict[bytes, list[Item]] = {}
    stack: list[Item] = []
    for it in blocks:
        if it[3] is not None and it[3] in held:
            children.setdefault(it[3], []).append(it)
        else:
            stack.append(it)
    stack.reverse()
    out = [CLEARED]
    while stack:
        it = stack.pop()
        out.append(it)
        stack.extend(reversed(children.pop(it[2], ())))
    return out + checkpoints


def items_to_events(
    items: Sequence[Item], *, block_size: int, hash_format: HashFormat, shared_medium: bool
) -> tuple[list[dict[str, Any]], int]:
    """The vLLM event maps for a run of items, and how many block events they carry.

    Consecutive stored items of one chain (each the previous one's child, same group, medium, tenant, and
    all with or all without tokens) become one ``BlockStored``; consecutive removals of one group and
    medium one ``BlockRemoved``. Checkpoints (one event each) follow the run of blocks they were stored with.
    Tenants travel as ``extra_keys`` (the cache salt, one entry per block)."""
    events: list[dict[str, Any]] = []
    blocks = 0
    run: list[Item] = []

    def medium_of(tier: int) -> str:
        return MEDIUM_EXTERNAL if shared_medium else TIER_MEDIUM[tier]

    def stored(items: list[Item]) -> dict[str, Any]:
        first = items[0]
        parent = None if first[3] is None else external_hash(first[3], hash_format)
        tokens: list[int] = []
        if first[7] is not None:
            for it in items:
                tokens.extend(it[7])
        tenant = first[6]
        return stored_event(
            [external_hash(it[2], hash_format) for it in items],
            parent,
            tokens,
            block_size,
            medium_of(first[5]),
            group=first[1],
            block_index=first[4],
            extra_keys=[(tenant,)] * len(items) if tenant else None,
        )

    checkpoints: list[Item] = []  # held back until the run they belong to is out: blocks before their state

    def close_stored() -> None:
        if run:
            events.append(stored(run))
            run.clear()
        for ck in checkpoints:
            events.append(stored([ck]))
        checkpoints.clear()

    removed: list[Item] = []

    def close_removed() -> None:
        if removed:
            first = removed[0]
            hashes = [external_hash(it[2], hash_format) for it in removed]
            events.append(removed_event(hashes, medium_of(first[3]), group=first[1]))
            removed.clear()

    for it in items:
        kind = it[0]
        if kind == "S":
            close_removed()
            blocks += 1
            if it[1] != GROUP_MLA:
                checkpoints.append(it)
                continue
            if run:
                last = run[-1]
                follows = (
                    it[3] == last[2]
                    and it[1] == last[1]
                    and it[5] == last[5]
                    and it[6] == last[6]
                    and (it[7] is None) == (last[7] is None)
                    and (it[4] is None if last[4] is None else it[4] == last[4] + 1)
                )
                if not follows:
                    close_stored()
            run.append(it)
        elif kind == "R":
            close_stored()
            if removed and (removed[0][1] != it[1] or removed[0][3] != it[3]):
                close_removed()
            removed.append(it)
            blocks += 1
        else:
            close_stored()
            close_removed()
            events.append(CLEARED_EVENT)
    close_stored()
    close_removed()
    return events, blocks
