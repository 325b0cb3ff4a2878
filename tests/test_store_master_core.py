"""MasterCore logic with a manual clock: the rules that are awkward to time over a real network."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvpool.kvstore.client.async_client import LocatedPrefix
from kvpool.kvstore.errors import BadRequestError, CapacityExceededError, ObjectNotFoundError
from kvpool.kvstore.keys import kda_key, mla_key
from kvpool.kvstore.master.core import MasterConfig, MasterCore, NodeAction
from kvpool.proto import common_pb2, master_pb2

from tests.harness.chains import chain
from tests.harness.clock import Clock

STARTED = master_pb2.PutStartReply.STARTED


def chain_metas(hs: list[bytes], size: int = 10, ck_every: int = 0) -> list[common_pb2.ObjectMeta]:
    metas, parent = [], b""
    for i, h in enumerate(hs):
        md = common_pb2.ObjectMeta(key=mla_key(h), kind=common_pb2.MLA_BLOCK, size=size, parent=parent)
        metas.append(md)
        parent = mla_key(h)
        if ck_every and (i + 1) % ck_every == 0:
            metas.append(common_pb2.ObjectMeta(key=kda_key(h), kind=common_pb2.KDA_CHECKPOINT, size=size))
    return metas


def register(core: MasterCore, node_id: str, dram: int, inventory=(), ssd: int = 0) -> int:
    reply = core.register_node(
        master_pb2.RegisterNodeRequest(
            node=common_pb2.NodeEndpoint(node_id=node_id, host="127.0.0.1", grpc_port=9),
            dram_capacity_bytes=dram,
            ssd_capacity_bytes=ssd,
            inventory=list(inventory),
        )
    )
    return reply.adopted_objects


def put(core: MasterCore, key: bytes, size: int = 10, **kw: object) -> master_pb2.PutStartReply:
    md = common_pb2.ObjectMeta(key=key, kind=kw.pop("kind", common_pb2.BLOB), size=size, **kw)  # type: ignore
    reply = core.put_start(master_pb2.PutStartRequest(meta=md))
    if reply.status == STARTED:
        core.put_commit(master_pb2.PutCommitRequest(put_id=reply.put_id))
    return reply


def orders(core: MasterCore) -> dict[tuple[str, NodeAction], list[bytes]]:
    out: dict[tuple[str, NodeAction], list[bytes]] = {}
    for batch in core.take_actions():
        for action, keys in batch.keys.items():
            out.setdefault((batch.node.node_id, action), []).extend(keys)
    return out


def test_reregistration_replaces_what_the_index_believed() -> None:
    core = MasterCore(clock=Clock(50.0))
    old, new = chain(5, "old"), chain(3, "new")
    assert register(core, "a", 10_000, chain_metas(old, ck_every=5)) == 6
    assert register(core, "a", 10_000, chain_metas(new, ck_every=3)) == 4  # node restarted, lost DRAM
    req = master_pb2.MatchPrefixRequest(block_hashes=old, require_checkpoint=True)
    assert core.match_prefix(req).mla_run_blocks == 0
    req = master_pb2.MatchPrefixRequest(block_hashes=new, require_checkpoint=True)
    assert core.match_prefix(req).usable_blocks == 3
    assert core.stats().objects == 4


def test_adoption_defers_eviction_until_the_forest_is_complete() -> None:
    """Inventory above the high watermark, children listed first: eviction afterwards is still leaf-first."""
    core = MasterCore(MasterConfig(high_watermark=0.8, low_watermark=0.5), clock=Clock(50.0))
    hs = chain(10)
    assert register(core, "a", 100, list(reversed(chain_metas(hs)))) == 10  # 100 bytes > 80
    st = core.stats()
    assert st.bytes <= 50 and st.evictions == 5
    req = master_pb2.MatchPrefixRequest(block_hashes=hs, require_checkpoint=False)
    assert core.match_prefix(req).usable_blocks == 5, "the root half survives, the suffix went"
    assert orders(core)[("a", NodeAction.DELETE)] == [mla_key(h) for h in reversed(hs[5:])]


def test_a_reput_on_the_same_node_keeps_the_queued_delete() -> None:
    """The old bytes must go before the new ones arrive (else the node refuses them as a duplicate): the
    delete stays queued, and the wire server answers the put only once it was sent (test_store_perf_semantics
    proves the whole remove -> re-put with other bytes against a real node)."""
    core = MasterCore(MasterConfig(high_watermark=0.9, low_watermark=0.5), clock=Clock(50.0))
    register(core, "a", 100)
    put(core, b"victim", 30)
    core.remove(master_pb2.RemoveRequest(keys=[b"victim"]))
    assert put(core, b"victim", 30).status == STARTED
    assert orders(core) == {("a", NodeAction.DELETE): [b"victim"]}


def test_tail_ttl_expiry_orders_delete() -> None:
    clock = Clock(50.0)
    core = MasterCore(clock=clock)
    register(core, "a", 1000)
    put(core, b"Treq", 10, kind=common_pb2.REQUEST_TAIL, ttl_ms=200)
    core.sweep()
    assert core.take_actions() == []
    clock.t += 0.3
    core.sweep()
    assert orders(core) == {("a", NodeAction.DELETE): [b"Treq"]}
    assert core.stats().expired == 1


def advance(core: MasterCore, clock: Clock, seconds: float) -> None:
    """Move time the way the server does: a sweep every sweep_ms."""
    step = core.config.sweep_ms / 1000.0
    end = clock.t + seconds
    while clock.t < end - 1e-9:
        clock.t = min(end, clock.t + step)
        core.sweep()


def test_node_loss_drops_pending_puts_and_objects() -> None:
    clock = Clock(50.0)
    core = MasterCore(MasterConfig(heartbeat_ms=100, node_timeout_ms=500), clock=clock)
    register(core, "a", 1000)
    reply = core.put_start(master_pb2.PutStartRequest(meta=common_pb2.ObjectMeta(key=b"k", kind=4, size=5)))
    put(core, b"done", 5)
    advance(core, clock, 0.4)
    core.heartbeat(master_pb2.HeartbeatRequest(node_id="a"))
    advance(core, clock, 0.4)
    assert core.stats().nodes == 1, "a node that heartbeats stays"
    advance(core, clock, 0.2)
    st = core.stats()
    assert (st.nodes, st.objects, st.pending_puts, st.bytes) == (0, 0, 0, 0)
    with pytest.raises(ObjectNotFoundError):
        core.put_commit(master_pb2.PutCommitRequest(put_id=reply.put_id))
    assert core.take_actions() == [], "nobody to tell: the node is gone"


def test_master_stall_is_not_blamed_on_nodes() -> None:
    """A sweep delayed by a long call (huge adoption, GC) must not declare healthy nodes dead."""
    clock = Clock(50.0)
    core = MasterCore(MasterConfig(heartbeat_ms=100, node_timeout_ms=500), clock=clock)
    register(core, "a", 1000)
    advance(core, clock, 0.3)
    clock.t += 2.0  # the loop was busy for 2 s: no sweep, no heartbeat handled
    core.sweep()
    assert core.stats().nodes == 1 and core.counters["sweep_stalls"] == 1
    core.heartbeat(master_pb2.HeartbeatRequest(node_id="a"))  # the queued heartbeat arrives
    advance(core, clock, 0.4)
    assert core.stats().nodes == 1
    advance(core, clock, 0.2)  # now it really is silent
    assert core.stats().nodes == 0


def test_replace_if_corrupt_places_elsewhere_and_deletes_the_bad_copy() -> None:
    core = MasterCore(clock=Clock(50.0))
    register(core, "a", 1000)
    put(core, b"k", 10)
    register(core, "b", 500)  # less free space than a: normal placement would pick a
    md = common_pb2.ObjectMeta(key=b"k", kind=4, size=10)
    assert core.put_start(master_pb2.PutStartRequest(meta=md)).status == master_pb2.PutStartReply.EXISTS
    reply = core.put_start(master_pb2.PutStartRequest(meta=md, replace_if_corrupt=True))
    assert reply.status == STARTED and reply.node.node_id == "b"
    assert core.lookup(master_pb2.LookupRequest(keys=[b"k"])).missing == [b"k"], "invisible until commit"
    assert orders(core) == {("a", NodeAction.DELETE): [b"k"]}
    assert put(core, b"k2", 10).node.node_id == "a"


def test_a_put_of_a_committed_object_refreshes_it() -> None:
    """The writer used it (prefill re-sends a chain whole): EXISTS touches, as the simulator's puts do, so
    the store's LRU is one recency order for every capacity (docs/design/workloads.md §3b)."""
    clock = Clock(10.0)
    core = MasterCore(clock=clock)
    register(core, "a", 1000)
    put(core, b"k", 10)
    clock.t = 20.0
    reply = put(core, b"k", 10)
    assert reply.status == master_pb2.PutStartReply.EXISTS and reply.node.node_id == "a"
    assert core.index.get(b"k").last_use == 20.0
    clock.t = 30.0
    with pytest.raises(BadRequestError):
        core.put_start(master_pb2.PutStartRequest(meta=common_pb2.ObjectMeta(key=b"k", kind=4, size=0)))
    assert core.index.get(b"k").last_use == 20.0, "a malformed put is refused, not a use"


def test_an_exists_only_lookup_answers_the_missing_keys_and_no_location() -> None:
    core = MasterCore(clock=Clock(5.0))
    register(core, "a", 1000)
    put(core, b"here", 10)
    core.put_start(master_pb2.PutStartRequest(meta=common_pb2.ObjectMeta(key=b"pending", kind=4, size=10)))
    reply = core.lookup(master_pb2.LookupRequest(keys=[b"here", b"gone", b"pending"], exists_only=True))
    assert list(reply.missing) == [b"gone", b"pending"] and not reply.found and not reply.lease_id
    with pytest.raises(BadRequestError, match="acquire"):
        core.lookup(master_pb2.LookupRequest(keys=[b"here"], exists_only=True, acquire=True))


def test_release_of_an_old_masters_lease_is_harmless() -> None:
    core = MasterCore(clock=Clock(50.0))
    register(core, "a", 1000)
    put(core, b"k", 10)
    got = core.lookup(master_pb2.LookupRequest(keys=[b"k"], acquire=True))
    assert got.lease_id.startswith(core.instance)
    core.release(master_pb2.ReleaseRequest(lease_id="deadbeef:1"))
    assert core.stats().active_leases == 1
    core.release(master_pb2.ReleaseRequest(lease_id=got.lease_id))
    assert core.stats().active_leases == 0
    assert core.stats().counters["releases_late"] == 1


def test_counts_only_match_for_routers() -> None:
    core = MasterCore(MasterConfig(high_watermark=0.9, low_watermark=0.5), clock=Clock(50.0))
    hs = chain(20)
    register(core, "a", 200, chain_metas(hs, size=9, ck_every=10), ssd=1000)  # 198 > 180: some to SSD
    full = core.match_prefix(master_pb2.MatchPrefixRequest(block_hashes=hs, require_checkpoint=True))
    fast = core.match_prefix(
        master_pb2.MatchPrefixRequest(block_hashes=hs, require_checkpoint=True, counts_only=True)
    )
    assert (fast.usable_blocks, fast.mla_run_blocks, list(fast.checkpoint_blocks)) == (20, 20, [10, 20])
    assert (full.usable_blocks, full.mla_run_blocks) == (20, 20)
    located = LocatedPrefix.of(full, hs, True)
    assert len(located.mla) == 20 and located.checkpoint is not None
    assert not fast.size and not fast.nodes  # counts only: no locations
    on_ssd = sum(loc.meta.tier == common_pb2.SSD for loc in located.mla)
    assert fast.usable_blocks_on_ssd == full.usable_blocks_on_ssd == on_ssd > 0


def test_stale_put_never_touches_the_put_that_replaced_it() -> None:
    """A pending tail whose TTL ran out frees its key; the next writer's put must survive the first put's
    commit attempt and deadline sweep."""
    clock = Clock(50.0)
    core = MasterCore(MasterConfig(put_deadline_ms=1000), clock=clock)
    register(core, "a", 1000)
    md = common_pb2.ObjectMeta(key=b"Tx", kind=common_pb2.REQUEST_TAIL, size=5, ttl_ms=100)
    first = core.put_start(master_pb2.PutStartRequest(meta=md))
    advance(core, clock, 0.2)  # the pending tail expired
    assert orders(core) == {("a", NodeAction.DELETE): [b"Tx"]}
    md.ttl_ms = 60_000
    second = core.put_start(master_pb2.PutStartRequest(meta=md))
    assert second.status == STARTED
    with pytest.raises(ObjectNotFoundError):
        core.put_commit(master_pb2.PutCommitRequest(put_id=first.put_id))
    advance(core, clock, 0.9)  # the first put's deadline passes: nothing of the second may go
    assert core.index.is_pending(b"Tx")
    core.put_commit(master_pb2.PutCommitRequest(put_id=second.put_id))
    assert core.lookup(master_pb2.LookupRequest(keys=[b"Tx"])).found


def test_quotas_and_pins_survive_a_restart(tmp_path: Path) -> None:
    from kvpool.kvstore.master.state import StateFileError

    state = tmp_path / "master-state.json"
    cfg = MasterConfig(high_watermark=0.9, low_watermark=0.5, state_path=state)
    first = MasterCore(cfg, clock=Clock(50.0))
    register(first, "a", 1000)
    put(first, b"sys", 300)
    put(first, b"other", 300)
    assert first.pin(master_pb2.PinRequest(keys=[b"sys", b"absent"], ttl_ms=3_600_000)).pinned == 1
    first.set_quota(master_pb2.SetQuotaRequest(tenant="t", max_bytes=100))
    # a new master life: nothing in memory, same state file, the node brings its inventory back
    second = MasterCore(cfg, clock=Clock(50.0))
    inventory = [common_pb2.ObjectMeta(key=k, kind=4, size=300) for k in (b"other", b"sys")]
    assert register(second, "a", 1000, inventory) == 2
    assert second.counters["pins_restored"] == 1
    put(second, b"fill", 350)  # 950 > 900: evict down to 500 -- the pinned object must stay
    assert second.lookup(master_pb2.LookupRequest(keys=[b"sys"])).found
    assert second.lookup(master_pb2.LookupRequest(keys=[b"other"])).missing == [b"other"]
    with pytest.raises(CapacityExceededError, match="quota"):
        put(second, b"big", 200, tenant="t")
    state.write_text("{not json")
    with pytest.raises(StateFileError):
        MasterCore(cfg, clock=Clock(50.0))
