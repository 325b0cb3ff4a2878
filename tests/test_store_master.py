"""The master in a real subprocess over the master wire: puts, leases, node loss, recovery, bad input,
health."""

from __future__ import annotations

import hashlib
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpool.kvstore.client.async_client import LocatedPrefix
from kvpool.kvstore.errors import BadRequestError, CapacityExceededError, ObjectNotFoundError, StoreError
from kvpool.kvstore.keys import kda_key, mla_key
from kvpool.kvstore.protocol.master_link import MasterLink
from kvpool.proto import common_pb2, master_pb2

from tests.harness.master_proc import DEADLINE_S, MasterProcess, ProbeNode, wait_until

T = DEADLINE_S
STARTED = master_pb2.PutStartReply.STARTED
EXISTS = master_pb2.PutStartReply.EXISTS
IN_PROGRESS = master_pb2.PutStartReply.IN_PROGRESS
FAST = ("--heartbeat-ms", "50", "--node-timeout-ms", "400", "--lease-ms", "300", "--put-deadline-ms", "400")


def chain(n: int, seed: str = "c") -> list[bytes]:
    out, prev = [], seed.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append(prev)
    return out


def meta(key: bytes, size: int = 100, kind: int = common_pb2.BLOB, **kw: object) -> common_pb2.ObjectMeta:
    return common_pb2.ObjectMeta(key=key, kind=kind, size=size, checksum=7, **kw)  # type: ignore[arg-type]


def put(m: MasterProcess, md: common_pb2.ObjectMeta) -> master_pb2.PutStartReply:
    """Two-phase put without payload (the probe node holds no bytes): start, then commit."""
    reply = m.call("PutStart", master_pb2.PutStartRequest(meta=md))
    if reply.status == STARTED:
        m.call("PutCommit", master_pb2.PutCommitRequest(put_id=reply.put_id))
    return reply


def put_chain(
    m: MasterProcess, hs: list[bytes], checkpoints: tuple[int, ...], size: int = 100
) -> list[tuple[common_pb2.ObjectMeta, str]]:
    """Put a hash chain's MLA blocks and checkpoints; returns each meta with the node it was placed on
    (what that node would report as its inventory)."""
    metas, parent = [], b""
    for i, h in enumerate(hs):
        metas.append(meta(mla_key(h), size, common_pb2.MLA_BLOCK, parent=parent))
        parent = mla_key(h)
        if i + 1 in checkpoints:
            metas.append(meta(kda_key(h), size * 4, common_pb2.KDA_CHECKPOINT))
    placed = []
    for md in metas:
        reply = put(m, md)
        assert reply.status == STARTED
        placed.append((md, reply.node.node_id))
    return placed


def match(m: MasterProcess, hs: list[bytes], **kw: object) -> LocatedPrefix:
    """MatchPrefix over the wire, its column-wise reply located as the store client does."""
    kw.setdefault("require_checkpoint", True)
    req = master_pb2.MatchPrefixRequest(block_hashes=hs, **kw)  # type: ignore[arg-type]
    reply = m.call("MatchPrefix", req)
    return LocatedPrefix.of(reply, hs, bool(kw["require_checkpoint"]), bool(kw.get("counts_only")))


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MasterProcess]:
    m = MasterProcess(tmp_path, *FAST)
    yield m
    m.kill()


@pytest.fixture
def node(master: MasterProcess) -> Iterator[ProbeNode]:
    n = ProbeNode("n0", master, dram=100_000)
    n.register()
    n.start_heartbeats()
    yield n
    n.close()


def test_two_phase_put_visible_only_after_commit(master: MasterProcess, node: ProbeNode) -> None:
    hs = chain(2)
    started = []
    pair = (
        meta(mla_key(hs[0]), kind=common_pb2.MLA_BLOCK),
        meta(kda_key(hs[0]), kind=common_pb2.KDA_CHECKPOINT),
    )
    for md in pair:
        reply = master.call("PutStart", master_pb2.PutStartRequest(meta=md))
        assert reply.status == STARTED and reply.node.node_id == "n0" and reply.node.grpc_port == node.port
        assert reply.deadline_ms == 400
        started.append(reply.put_id)
    assert match(master, hs).mla_run_blocks == 0, "a pending put must be invisible"
    assert list(master.call("Lookup", master_pb2.LookupRequest(keys=[mla_key(hs[0])])).missing)
    for put_id in started:
        master.call("PutCommit", master_pb2.PutCommitRequest(put_id=put_id))
    got = match(master, hs)
    assert (got.usable_blocks, got.mla_run_blocks, list(got.checkpoint_blocks)) == (1, 1, [1])
    assert got.mla[0].meta.key == mla_key(hs[0]) and got.mla[0].node.node_id == "n0"
    assert got.checkpoint.meta.key == kda_key(hs[0]) and got.checkpoint.meta.checksum == 7
    assert put(master, meta(mla_key(hs[0]), kind=common_pb2.MLA_BLOCK)).status == EXISTS


def test_concurrent_duplicate_puts_start_exactly_once(master: MasterProcess, node: ProbeNode) -> None:
    key = b"dup-key"
    barrier = threading.Barrier(16)
    statuses: list[int] = []
    lock = threading.Lock()

    def racer() -> None:
        barrier.wait(timeout=T)
        reply = master.call("PutStart", master_pb2.PutStartRequest(meta=meta(key)))
        with lock:
            statuses.append(reply.status)

    threads = [threading.Thread(target=racer) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=T)
    assert statuses.count(STARTED) == 1
    assert len(statuses) == 16 and all(s in (STARTED, EXISTS, IN_PROGRESS) for s in statuses)
    assert statuses.count(IN_PROGRESS) == 15, "nothing committed yet: the losers see the put in progress"


def test_abandoned_put_is_aborted_and_node_told_to_delete(master: MasterProcess, node: ProbeNode) -> None:
    reply = master.call("PutStart", master_pb2.PutStartRequest(meta=meta(b"abandoned")))
    assert reply.status == STARTED
    assert master.stats().pending_puts == 1
    took = wait_until(lambda: master.stats().pending_puts == 0, timeout_s=3.0)
    assert took < 1.5
    wait_until(lambda: b"abandoned" in node.orders("delete"), timeout_s=3.0)
    with pytest.raises(ObjectNotFoundError):
        master.call("PutCommit", master_pb2.PutCommitRequest(put_id=reply.put_id))
    assert master.stats().counters["puts_abandoned"] == 1
    # the key is free again
    assert put(master, meta(b"abandoned")).status == STARTED


def test_abort_frees_key_and_orders_delete(master: MasterProcess, node: ProbeNode) -> None:
    reply = master.call("PutStart", master_pb2.PutStartRequest(meta=meta(b"k")))
    master.call("PutAbort", master_pb2.PutAbortRequest(put_id=reply.put_id, reason="transfer failed"))
    wait_until(lambda: b"k" in node.orders("delete"), timeout_s=3.0)
    with pytest.raises(ObjectNotFoundError):
        master.call("PutAbort", master_pb2.PutAbortRequest(put_id=reply.put_id))


def test_lease_pins_until_release_or_deadline(master: MasterProcess, tmp_path: Path) -> None:
    n = ProbeNode("small", master, dram=1000)
    n.register()
    n.start_heartbeats()
    try:
        hs = chain(2)
        put_chain(master, hs, checkpoints=(2,), size=100)  # 100 + 100 + 400 bytes
        got = match(master, hs, acquire=True, lease_ms=5000)
        assert got.usable_blocks == 2 and got.lease_id
        assert master.stats().active_leases == 1
        put(master, meta(b"fill", 390))  # 990 > 950: evict to 850 -- the leased chain cannot go
        assert match(master, hs).usable_blocks == 2
        master.call("Release", master_pb2.ReleaseRequest(lease_id=got.lease_id))
        master.call("Release", master_pb2.ReleaseRequest(lease_id=got.lease_id))  # idempotent
        put(master, meta(b"fill2", 10))
        assert match(master, hs).usable_blocks == 0, "released: the cold chain is evicted first"
        wait_until(lambda: kda_key(hs[1]) in n.orders("delete"), timeout_s=3.0)
        # now a lease nobody releases: the deadline (default --lease-ms 300) lets it go
        hs2 = chain(1, "other")
        put_chain(master, hs2, checkpoints=(1,), size=50)
        assert match(master, hs2, acquire=True).lease_id
        wait_until(lambda: master.stats().active_leases == 0, timeout_s=3.0)
    finally:
        n.close()


def test_probes_do_not_pin_or_refresh(master: MasterProcess) -> None:
    n = ProbeNode("small", master, dram=1000)
    n.register()
    n.start_heartbeats()
    try:
        hs = chain(1)
        put_chain(master, hs, checkpoints=(1,), size=100)
        put(master, meta(b"newer", 100))
        for _ in range(200):
            assert match(master, hs).usable_blocks == 1  # acquire=false: a probe
        assert master.stats().active_leases == 0
        put(master, meta(b"fill", 400))  # 1000 > 950 -> evict to 850: the probed chain is the oldest
        assert match(master, hs).usable_blocks == 0
    finally:
        n.close()


def test_dead_node_dropped_within_deadline(master: MasterProcess, node: ProbeNode) -> None:
    put_chain(master, chain(3), checkpoints=(3,))
    assert master.stats().objects == 4
    node.stop_heartbeats()
    stopped = time.monotonic()
    wait_until(lambda: master.stats().nodes == 0, timeout_s=3.0)
    took = time.monotonic() - stopped
    assert took < 0.4 + 1.0, f"dropped after {took:.2f}s: deadline 0.4 s + a sweep (+ slack, loaded host)"
    st = master.stats()
    assert st.objects == 0 and st.bytes == 0 and st.counters["nodes_lost"] == 1
    assert match(master, chain(3)).mla_run_blocks == 0
    beat = master.call("Heartbeat", master_pb2.HeartbeatRequest(node_id="n0"))
    assert beat.reregister, "an unknown node is asked to re-register with its inventory"
    with pytest.raises(CapacityExceededError):  # no node left: placement fails cleanly
        master.call("PutStart", master_pb2.PutStartRequest(meta=meta(b"x")))


def test_restarted_master_rebuilds_from_inventories(tmp_path: Path) -> None:
    m1 = MasterProcess(tmp_path, "--heartbeat-ms", "50", "--node-timeout-ms", "2000")
    a = ProbeNode("a", m1, dram=1_000_000)
    b = ProbeNode("b", m1, dram=1_000_000, ssd=1_000_000)
    try:
        a.register()
        b.register()
        hs, other = chain(40), chain(10, "other")
        placed = put_chain(m1, hs, checkpoints=(8, 31), size=1000) + put_chain(m1, other, checkpoints=(10,))
        assert {node for _, node in placed} == {"a", "b"}, "placement by free space uses both nodes"
        before = [match(m1, hs), match(m1, other), match(m1, hs[:20], require_checkpoint=False)]
        m1.kill()  # SIGKILL: no goodbye, nothing persisted
        m2 = MasterProcess(tmp_path, "--heartbeat-ms", "50", "--node-timeout-ms", "2000")
        try:
            a.master = b.master = m2
            assert m2.stats().objects == 0
            for probe in (a, b):
                beat = m2.call("Heartbeat", master_pb2.HeartbeatRequest(node_id=probe.node_id))
                assert beat.reregister
            # each node reports what it holds; children before parents on purpose (order must not matter)
            for probe in (a, b):
                held = [md for md, node in reversed(placed) if node == probe.node_id]
                assert probe.register(held).adopted_objects == len(held)
            after = [match(m2, hs), match(m2, other), match(m2, hs[:20], require_checkpoint=False)]
            for x, y in zip(before, after, strict=True):
                assert (x.usable_blocks, x.mla_run_blocks, list(x.checkpoint_blocks)) == (
                    y.usable_blocks,
                    y.mla_run_blocks,
                    list(y.checkpoint_blocks),
                )
                assert [loc.meta.key for loc in x.mla] == [loc.meta.key for loc in y.mla]
                assert [loc.node.node_id for loc in x.mla] == [loc.node.node_id for loc in y.mla]
            assert after[0].usable_blocks == 31 and after[1].usable_blocks == 10
            # an object that both nodes claim is kept once; the other copy is deleted
            dup, owner = placed[0]
            other_node = b if owner == "a" else a
            assert other_node.register([dup]).adopted_objects == 0
            wait_until(lambda: dup.key in other_node.orders("delete"), timeout_s=3.0)
        finally:
            m2.kill()
    finally:
        a.close()
        b.close()


def test_bad_input_gets_clear_errors_and_server_keeps_serving(master: MasterProcess, node: ProbeNode) -> None:
    bad, exhausted = BadRequestError, CapacityExceededError
    cases = [
        ("MatchPrefix", master_pb2.MatchPrefixRequest(block_hashes=[b"short"]), bad, "32 bytes"),
        ("PutStart", master_pb2.PutStartRequest(meta=meta(b"")), bad, "key"),
        ("PutStart", master_pb2.PutStartRequest(meta=meta(b"k", size=0)), bad, "size"),
        (
            "PutStart",
            master_pb2.PutStartRequest(meta=meta(b"M" + b"x" * 3, kind=common_pb2.MLA_BLOCK)),
            bad,
            "MLA",
        ),
        ("PutStart", master_pb2.PutStartRequest(meta=meta(b"T1", kind=common_pb2.REQUEST_TAIL)), bad, "TTL"),
        ("PutStart", master_pb2.PutStartRequest(meta=meta(b"huge", size=10**12)), exhausted, "capacity"),
        ("PutStart", master_pb2.PutStartRequest(meta=meta(b"k", kind=99)), bad, "kind"),
        ("PutCommit", master_pb2.PutCommitRequest(put_id="nope"), ObjectNotFoundError, "nope"),
        ("PutCommit", master_pb2.PutCommitRequest(), bad, "empty"),
        ("Release", master_pb2.ReleaseRequest(lease_id="garbage"), bad, "lease"),
        ("Lookup", master_pb2.LookupRequest(keys=[b"x" * 2000]), bad, "key"),
        ("MatchPrefix", master_pb2.MatchPrefixRequest(lease_ms=10**7), bad, "lease_ms"),
        ("Pin", master_pb2.PinRequest(keys=[b"k"], ttl_ms=10**9), bad, "ttl"),
        (
            "RegisterNode",
            master_pb2.RegisterNodeRequest(node=common_pb2.NodeEndpoint(node_id="x")),
            bad,
            "host",
        ),
        ("Heartbeat", master_pb2.HeartbeatRequest(), bad, "node_id"),
        ("MatchPrefix", master_pb2.MatchPrefixRequest(block_hashes=[b"\0" * 32] * 70_000), bad, "more than"),
    ]
    for name, request, error, words in cases:
        with pytest.raises(StoreError) as err:
            master.call(name, request)
        assert type(err.value) is error, (request, err.value)
        assert words.lower() in str(err.value).lower(), err.value
    assert put(master, meta(b"still-works")).status == STARTED
    assert master.stats().counters["rpc_bad_request"] >= 10


def test_remove_pin_quota_and_eviction_orders(master: MasterProcess) -> None:
    n = ProbeNode("small", master, dram=1000)
    n.register()
    n.start_heartbeats()
    try:
        put(master, meta(b"sys-prompt", 300, tenant="t1"))
        assert (
            master.call("Pin", master_pb2.PinRequest(keys=[b"sys-prompt", b"absent"], ttl_ms=60_000)).pinned
            == 1
        )
        for i in range(8):
            put(master, meta(f"o{i}".encode(), 100, tenant="t2"))
        assert master.call("Lookup", master_pb2.LookupRequest(keys=[b"sys-prompt"])).found
        wait_until(lambda: len(n.orders("delete")) >= 1, timeout_s=3.0)
        assert b"sys-prompt" not in n.orders("delete")
        master.call("SetQuota", master_pb2.SetQuotaRequest(tenant="t2", max_bytes=200))
        st = master.stats()
        assert st.bytes_per_tenant["t2"] <= 200 and st.bytes_per_tenant["t1"] == 300
        with pytest.raises(CapacityExceededError, match="quota"):
            master.call("PutStart", master_pb2.PutStartRequest(meta=meta(b"big", 300, tenant="t2")))
        removed = master.call("Remove", master_pb2.RemoveRequest(keys=[b"sys-prompt", b"absent"]))
        assert removed.removed == 1
        wait_until(lambda: b"sys-prompt" in n.orders("delete"), timeout_s=3.0)
    finally:
        n.close()


def test_ssd_tier_demotes_and_promotes_on_fetch(master: MasterProcess) -> None:
    n = ProbeNode("tiered", master, dram=1000, ssd=10_000)
    n.register()
    n.start_heartbeats()
    try:
        hs = chain(12)
        put_chain(master, hs, checkpoints=(12,), size=100)  # 1600 bytes > DRAM: oldest demoted
        wait_until(lambda: len(n.orders("demote")) > 0, timeout_s=3.0)
        st = master.stats()
        assert st.bytes_per_tier["SSD"] > 0 and st.demotions > 0 and st.evictions == 0
        got = match(master, hs)
        assert got.usable_blocks == 12 and any(loc.meta.tier == common_pb2.SSD for loc in got.mla)
        fetched = match(master, hs[:2], require_checkpoint=False, acquire=True)
        assert all(loc.meta.tier == common_pb2.DRAM for loc in fetched.mla)
        wait_until(lambda: mla_key(hs[0]) in n.orders("promote"), timeout_s=3.0)
    finally:
        n.close()


def test_kvpool_cli_health_metrics_and_clean_sigterm(tmp_path: Path) -> None:
    master = MasterProcess(
        tmp_path, "--policy", "cost", "--metrics-port", "0", "--max-objects", "5000", via_kvpool_cli=True
    )
    st = master.stats()
    assert st.policy == "cost" and st.max_objects == 5000 and st.rss_bytes > 10 << 20 and st.index_slots > 0
    assert master.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/metrics", timeout=T) as resp:
        text = resp.read().decode()
    assert "kvpool_master_objects 0" in text and 'kvpool_master_info{policy="cost"} 1' in text
    assert "kvpool_master_max_objects 5000" in text and "\nkvpool_master_rss_bytes " in text
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/nope", timeout=T)
    described = master.call("Describe", master_pb2.DescribeRequest())  # what health probes ask
    assert described.leader and described.instance
    assert master.terminate() == 0


def _demotions_failed_back(master: MasterProcess, n: ProbeNode, puts: int) -> None:
    """Await (bounded) the state every failed demotion must leave: nothing counted on SSD, each demoted
    object dropped from the index and deleted on its node. The master counts a demotion on SSD when it
    orders it and the orders of consecutive puts reach the node one call after another, so the state is
    awaited as a whole, never judged from a snapshot taken between two of those calls."""
    last: dict[str, object] = {}

    def settled() -> bool:
        demoted, deleted = n.orders("demote"), set(n.orders("delete"))
        st = master.stats()
        last.update(ssd=st.bytes_per_tier["SSD"], objects=st.objects, demoted=len(demoted))
        last.update(failed=st.counters.get("demotions_failed", 0), deleted=len(set(demoted) & deleted))
        return (
            bool(demoted)
            and st.bytes_per_tier["SSD"] == 0
            and st.objects == puts - len(demoted)
            and last["failed"] == len(demoted)
            and set(demoted) <= deleted
        )

    try:
        wait_until(settled, timeout_s=DEADLINE_S)
    except TimeoutError:
        pytest.fail(f"failed demotions never settled: {last}")


def test_failed_demotion_drops_the_object_and_orders_delete(master: MasterProcess) -> None:
    """A node whose SSD refuses a demotion keeps the bytes in DRAM: the master must not count them on SSD."""
    n = ProbeNode("tiered", master, dram=1000, ssd=10_000)
    n.recorder.refuse.add("demote")
    n.register()
    n.start_heartbeats()
    try:
        for i in range(12):
            put(master, meta(f"o{i}".encode(), 100))
        _demotions_failed_back(master, n, puts=12)
    finally:
        n.close()


def test_a_demotion_call_that_times_out_is_uncounted_like_a_refusal(tmp_path: Path) -> None:
    """A node that never answers a demotion may still hold the bytes in DRAM: the master must not keep
    counting them on SSD (it used to, until the node registered again)."""
    m = MasterProcess(tmp_path, *FAST, "--node-call-timeout-ms", "200")
    try:
        n = ProbeNode("hung", m, dram=1000, ssd=10_000)
    except BaseException:
        m.kill()
        raise
    n.recorder.stall.add("demote")
    n.recorder.stall_s = 0.6
    try:
        n.register()
        n.start_heartbeats()
        for i in range(12):
            put(m, meta(f"o{i}".encode(), 100))
        _demotions_failed_back(m, n, puts=12)
        assert m.stats().counters.get("node_demote_failed", 0) >= 1
    finally:
        n.close()
        m.kill()


def test_the_client_link_drives_the_same_master(master: MasterProcess, node: ProbeNode) -> None:
    """Store clients call the master through MasterLink (asyncio, multiplexed) rather than one blocking
    call per connection: the same calls and answers."""
    import asyncio

    hs = chain(3)
    put_chain(master, hs, checkpoints=(3,))

    async def run() -> tuple[int, int]:
        async with MasterLink(master.address, T) as link:
            req = master_pb2.MatchPrefixRequest(block_hashes=hs, require_checkpoint=True, acquire=True)
            got = await link.match_prefix(req)
            await link.release(master_pb2.ReleaseRequest(lease_id=got.lease_id))
            stats = await link.stats(master_pb2.StatsRequest())
            return got.usable_blocks, stats.active_leases

    assert asyncio.run(run()) == (3, 0)


@pytest.mark.slow
def test_large_inventory_adoption(tmp_path: Path) -> None:
    """A node holding 200k objects (a ~15 MB RegisterNode, over gRPC's 4 MB default) is adopted in one
    call, and the stall it causes does not get a heartbeating neighbour declared dead."""
    # The inventory is built before any heartbeat starts: building 200k protobufs holds this process's GIL,
    # which would starve the probe's own heartbeat thread and test the test, not the master.
    hs = chain(200_000, "big")
    inventory, parent = [], b""
    for h in hs:
        inventory.append(meta(mla_key(h), 1 << 20, common_pb2.MLA_BLOCK, parent=parent))
        parent = mla_key(h)
    m = MasterProcess(tmp_path, "--heartbeat-ms", "100", "--node-timeout-ms", "1500")
    big = ProbeNode("big", m, dram=1 << 40)
    small = ProbeNode("small", m, dram=1 << 20)
    try:
        small.register()
        small.start_heartbeats()
        t = time.monotonic()
        assert big.register(inventory).adopted_objects == 200_000
        took = time.monotonic() - t
        big.start_heartbeats()
        time.sleep(0.5)
        st = m.stats()
        assert st.objects == 200_000 and st.nodes == 2, f"adoption took {took:.1f}s"
        got = match(m, hs[:2000], require_checkpoint=False, counts_only=True)
        assert got.usable_blocks == 2000
    finally:
        big.close()
        small.close()
        m.kill()


def test_state_file_keeps_quotas_across_a_kill(tmp_path: Path) -> None:
    state = str(tmp_path / "state.json")
    m1 = MasterProcess(tmp_path, "--state-file", state)
    m1.call("SetQuota", master_pb2.SetQuotaRequest(tenant="t", max_bytes=100))
    m1.kill()
    m2 = MasterProcess(tmp_path, "--state-file", state)
    n = ProbeNode("n", m2, dram=10_000)
    try:
        n.register()
        with pytest.raises(CapacityExceededError, match="quota"):
            m2.call("PutStart", master_pb2.PutStartRequest(meta=meta(b"k", 200, tenant="t")))
    finally:
        n.close()
        m2.kill()
