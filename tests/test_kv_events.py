"""KV events (docs/design/kv_events.md): a real master process publishes, real ZMQ sockets consume.

What is proven here: the vLLM mapping (stored on commit with tokens, salt and the hybrid group, removed
on remove / node loss, cleared on a new life), that the reference subscriber's mirror answers match_prefix
as the master does, recovery (replay, snapshot after a stale request, a new incarnation after a restart)
and bad input (a subscriber that never reads does not slow the master; malformed replay requests are
counted and ignored).
The same stream decoded with vLLM's own classes: tests/vllm_connector/test_kv_events_vllm.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from kvpool.kvstore.keys import kda_key, mla_key
from kvpool.kvstore.protocol.kv_events_wire import GROUP_CHECKPOINT, GROUP_MLA, decode_seq, encode_seq
from kvpool.proto import common_pb2, master_pb2

from tests.harness.kv_events import (
    BLOCK,
    chain,
    endpoints,
    free_port,
    master_match,
    put_chain,
    settle,
    start_master,
    subscriber,
    tokens_of,
)
from tests.harness.master_proc import MasterProcess, ProbeNode, wait_until


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MasterProcess]:
    m = start_master(tmp_path, "--kv-events-buffer", "4", "--kv-events-keep-tokens")
    yield m
    m.kill()


@pytest.fixture
def node(master: MasterProcess) -> Iterator[ProbeNode]:
    n = ProbeNode("n0", master, dram=10_000_000)
    n.register()
    n.start_heartbeats()
    yield n
    n.close()


def test_stored_removed_and_the_hybrid_form_mirror_match_prefix(
    master: MasterProcess, node: ProbeNode
) -> None:
    raw = zmq.Context.instance().socket(zmq.SUB)
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(endpoints(master)[0])
    sub = subscriber(master)
    # the raw socket cannot recover a missed batch by replay: it must be joined before the puts, which its
    # first message proves (the idle stream's heartbeat comes every second)
    assert raw.poll(10_000), "no heartbeat reached the raw subscriber"
    raw.recv_multipart()
    hs = chain(6, "a")
    put_chain(master, hs, checkpoints=(2, 5), tenant="acme")
    settle(sub, lambda: len(sub.blocks[GROUP_MLA]) == 6 and len(sub.blocks[GROUP_CHECKPOINT]) == 2)
    # the raw events: one BlockStored for the whole run (tokens, salt, positions), one per checkpoint
    stored = []
    while raw.poll(1000):
        tpc, _, payload = raw.recv_multipart()
        ts, events, rank = msgpack.unpackb(payload)
        assert tpc.startswith(b"kvpool/0/") and rank == 0 and abs(time.time() - ts) < 5
        stored += [e for e in events if e["type"] == "BlockStored"]
        if len(stored) >= 3:
            break
    runs = [e for e in stored if e["group_idx"] == GROUP_MLA]
    assert len(runs) == 1 and runs[0]["block_hashes"] == hs and runs[0]["parent_block_hash"] is None
    assert runs[0]["token_ids"] == [t for i in range(6) for t in tokens_of(i)]
    assert runs[0]["block_size"] == BLOCK and runs[0]["medium"] == "CPU" and runs[0]["block_index"] == 0
    assert runs[0]["extra_keys"] == [["acme"]] * 6 and runs[0]["kv_cache_spec_kind"] == "mla_attention"
    ckpts = sorted((e for e in stored if e["group_idx"] == GROUP_CHECKPOINT), key=lambda e: e["block_index"])
    assert [(e["block_hashes"], e["block_index"], e["kv_cache_spec_kind"]) for e in ckpts] == [
        ([hs[1]], 1, "mamba"),
        ([hs[4]], 4, "mamba"),
    ]
    assert ckpts[0]["parent_block_hash"] == hs[0], "a checkpoint names its block's parent"
    assert sub.block_index[hs[5]] == 5 and sub.token_ids[hs[3]] == tokens_of(3)
    # the joint rule from the mirror equals the master's
    for probe in (hs, hs[:4], hs[:1]):
        for rule in (True, False):
            assert sub.match_prefix(probe, rule) == master_match(master, probe, rule)
    assert sub.match_prefix(hs) == (5, 6)
    # a removal (the checkpoint at 5): usable falls back to 2 on both sides
    master.call("Remove", master_pb2.RemoveRequest(keys=[kda_key(hs[4])]))
    settle(sub, lambda: len(sub.blocks[GROUP_CHECKPOINT]) == 1)
    assert sub.match_prefix(hs) == master_match(master, hs) == (2, 6)
    # node lost: everything it held is removed
    node.stop_heartbeats()
    settle(sub, lambda: not sub.blocks[GROUP_MLA] and not sub.blocks[GROUP_CHECKPOINT])
    assert sub.match_prefix(hs) == master_match(master, hs) == (0, 0)
    assert sub.stats.gaps == 1 and sub.stats.snapshots == 0, (
        "joined after batch 0: one replay from the buffer"
    )
    sub.close()
    raw.close(0)


def test_stale_subscriber_converges_by_snapshot_and_never_slows_the_master(
    master: MasterProcess, node: ProbeNode
) -> None:
    # a subscriber that never reads, with a tiny queue: ZMQ drops for it alone
    ctx = zmq.Context.instance()
    deaf = ctx.socket(zmq.SUB)
    deaf.setsockopt(zmq.RCVHWM, 1)
    deaf.setsockopt(zmq.SUBSCRIBE, b"")
    deaf.connect(endpoints(master)[0])
    put_chain(master, chain(2, "first"), checkpoints=(2,))
    chains = [chain(8, f"c{i}") for i in range(40)]
    slowest = 0.0
    for hs in chains:
        t = time.monotonic()
        put_chain(master, hs, checkpoints=(4, 8))
        slowest = max(slowest, time.monotonic() - t)
    assert slowest < 1.0, f"a put batch took {slowest:.2f}s with a deaf subscriber"
    late = subscriber(master)  # joins late: its first message is not seq 0 of this life -> replay(0)
    master.call("Remove", master_pb2.RemoveRequest(keys=[kda_key(chains[0][7])]))  # one more batch
    t = time.monotonic()
    settle(late, lambda: late.stats.snapshots >= 1 and late.last_seq >= 0)
    settle(late, lambda: len(late.blocks[GROUP_MLA]) == 2 + 40 * 8)
    took = time.monotonic() - t
    assert took < 3.0
    assert late.stats.snapshots == 1, "replay from 0 with 4 batches buffered is the snapshot path"
    for hs in [*chains[:5], chain(2, "first")]:
        assert late.match_prefix(hs) == master_match(master, hs)
    assert late.match_prefix(chains[0]) == (4, 8)
    assert late.token_ids[chains[3][2]] == tokens_of(2), "--kv-events-keep-tokens: the snapshot has tokens"
    counters = master.stats().counters
    assert counters["kv_events_snapshots"] == 1 and counters["kv_events_snapshot_blocks"] >= 2 + 40 * 10
    assert counters["kv_events_published_blocks"] >= 2 + 40 * 10
    late.close()
    deaf.close(0)


def test_replay_from_buffer_and_malformed_requests_are_counted(
    master: MasterProcess, node: ProbeNode
) -> None:
    sub = subscriber(master)
    for i in range(3):
        put_chain(master, chain(3, f"r{i}"))
    settle(sub, lambda: len(sub.blocks[GROUP_MLA]) == 9)
    last = sub.last_seq
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoints(master)[1])
    # malformed: wrong frame count, wrong length, a negative start
    dealer.send_multipart([b"", b"abc"])
    dealer.send_multipart([b"", encode_seq(1), b"extra"])
    dealer.send_multipart([b"", encode_seq(-5)])
    dealer.send_multipart([b"garbage"])
    # a good one within the buffer (4 batches): the buffered batches, then -1
    dealer.send_multipart([b"", encode_seq(last - 1)])
    got = []
    while True:
        assert dealer.poll(3000), "no replay answer"
        _, tpc, seq, _ = dealer.recv_multipart()
        if decode_seq(seq) == -1:
            break
        assert not tpc.endswith(b"/snapshot")
        got.append(decode_seq(seq))
    assert got[:2] == [last - 1, last] and got == list(range(last - 1, last - 1 + len(got)))  # (+ heartbeats)
    wait_until(lambda: master.stats().counters.get("kv_events_replay_malformed", 0) == 4, timeout_s=3.0)
    assert master.stats().counters["kv_events_snapshots"] == 0
    put_chain(master, chain(2, "after"))  # the master and the stream go on
    settle(sub, lambda: len(sub.blocks[GROUP_MLA]) == 11)
    dealer.close(0)
    sub.close()


def test_a_restarted_master_is_a_new_incarnation_and_adopted_blocks_are_stored(tmp_path: Path) -> None:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    m1 = start_master(tmp_path, pub=pub, replay=replay)
    node = ProbeNode("n0", m1, dram=10_000_000)
    try:
        node.register()
        node.start_heartbeats()  # (to whichever master node.master names)
        sub = subscriber(m1)
        hs = chain(5, "life")
        metas = put_chain(m1, hs, checkpoints=(3,))
        settle(sub, lambda: len(sub.blocks[GROUP_MLA]) == 5)
        first = sub.topic
        m1.kill()
        m2 = start_master(tmp_path, pub=pub, replay=replay)
        try:
            node.master = m2
            # the new life's batch 0 (AllBlocksCleared) went out before the subscriber's SUB reconnected;
            # the idle heartbeat batch (every 1 s) has the new topic and is not seq 0: replay from 0, cleared
            settle(sub, lambda: sub.topic != first and not sub.blocks[GROUP_MLA], timeout_s=10.0)
            assert sub.stats.incarnations == 2
            # the node re-registers with part of what it held (children first on purpose)
            kept = [
                md
                for md in metas
                if md.key in (mla_key(hs[0]), mla_key(hs[1]), mla_key(hs[2]), kda_key(hs[2]))
            ]
            assert node.register(list(reversed(kept))).adopted_objects == 4
            settle(sub, lambda: len(sub.blocks[GROUP_CHECKPOINT]) == 1)
            assert sub.stats.incarnations == 2 and len(sub.blocks[GROUP_MLA]) == 3
            assert sub.match_prefix(hs) == master_match(m2, hs) == (3, 3)
        finally:
            m2.kill()
        sub.close()
    finally:
        node.close()


def test_bad_kv_events_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool.kvstore.cli import main

    assert main(["master", "--kv-events", "localhost:5557"]) == 2
    assert "--kv-events needs a ZMQ address" in capsys.readouterr().err
    assert main(["master", "--kv-events-replay", "tcp://127.0.0.1:0"]) == 2
    assert "--kv-events-replay needs --kv-events" in capsys.readouterr().err


def test_the_store_clients_puts_carry_their_tokens_to_the_stream(
    master: MasterProcess, tmp_path: Path
) -> None:
    """The real put path: a storage node, the store client's batch_put with PutItem.token_ids."""
    import asyncio

    from kvpool.kvstore.client.async_client import AsyncStoreClient, PutItem

    from tests.store_helpers import start_node

    node = start_node(tmp_path, master.address, "16MiB", "tcp")
    sub = subscriber(master)
    hs = chain(3, "client")

    async def push() -> list[object]:
        items, parent = [], b""
        for i, h in enumerate(hs):
            items.append(
                PutItem(mla_key(h), b"x" * 64, common_pb2.MLA_BLOCK, parent=parent, token_ids=tokens_of(i))
            )
            parent = mla_key(h)
        items.append(PutItem(kda_key(hs[-1]), b"y" * 64, common_pb2.KDA_CHECKPOINT))
        async with AsyncStoreClient(master.address, transport="tcp") as client:
            return await client.batch_put(items)

    try:
        assert asyncio.run(push()) == [None] * 4
        settle(sub, lambda: len(sub.blocks[GROUP_CHECKPOINT]) == 1)
        assert [sub.token_ids[h] for h in hs] == [tokens_of(i) for i in range(3)]
        assert sub.match_prefix(hs) == master_match(master, hs) == (3, 3)
    finally:
        sub.close()
        node.stop()


def test_a_new_ha_leader_core_is_a_new_incarnation() -> None:
    """HA replaces the server's core on every election (kvstore/master/ha.py: ``replace_core``): the stream
    starts a new incarnation named by the new core's id and epoch, from sequence 0, with AllBlocksCleared."""
    import asyncio

    from kvpool.kvstore.master.core import MasterConfig, MasterCore
    from kvpool.kvstore.master.kv_events_config import KvEventsConfig
    from kvpool.kvstore.master.server import MasterServer

    async def run() -> tuple[str, str, tuple[bytes, int, list[str]]]:
        # heartbeats on: the first one received proves the subscription is live (ZMQ drops what a publisher
        # sends before a subscriber has joined), so nothing below waits a fixed time for anything
        events = KvEventsConfig("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", heartbeat_ms=50)
        server = MasterServer(MasterConfig(), kv_events=events)
        await server.start()
        assert server.kv_events is not None
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(server.kv_events.endpoint)

        async def next_batch(deadline: float) -> tuple[bytes, int, list[str]]:
            while not sock.poll(0):  # the loop must keep running: the publisher's heartbeats are on it
                assert time.monotonic() < deadline, "no batch from the publisher in time"
                await asyncio.sleep(0.01)
            tpc, seq, payload = sock.recv_multipart()
            _, evs, _ = msgpack.unpackb(payload)
            return tpc, decode_seq(seq), [e["type"] for e in evs]

        try:
            deadline = time.monotonic() + 20.0
            first = server.kv_events.topic
            assert (await next_batch(deadline))[0] == first.encode()  # subscribed
            server.replace_core(MasterCore(MasterConfig(), epoch=7))  # what HaMaster._elected does
            second = server.kv_events.topic
            while (batch := await next_batch(deadline))[0] != second.encode():
                # the first life's batches still in flight: its heartbeats (or its batch 0), nothing new
                assert batch[0] == first.encode() and batch[2] in ([], ["AllBlocksCleared"]), batch
            return first, second, batch
        finally:
            sock.close(0)
            await server.stop()

    first, second, batch = asyncio.run(run())
    assert first != second and second.endswith(".7")
    assert batch == (second.encode(), 0, ["AllBlocksCleared"])  # the new life's first batch


def test_a_late_replay_answer_is_never_taken_for_the_next_replays() -> None:
    """A replay that timed out must not leave its answer to be read by the next one: the publisher here (a
    plain ROUTER socket, so that it can answer late on purpose) answers the first request only after the
    subscriber gave up on it, then answers the second; the mirror must hold the second answer alone."""
    from kvpool.kvstore.client.kv_events import KvEventsReplayTimeoutError, KvEventSubscriber
    from kvpool.kvstore.protocol.kv_events_wire import END_SEQ, encode_batch

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    sub = KvEventSubscriber(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{port}")
    try:
        sub.topic = b"kvpool"

        def answer(identity: bytes, block_hash: bytes) -> None:
            stored = {
                "type": "BlockStored", "block_hashes": [block_hash], "medium": "GPU", "group_idx": GROUP_MLA,
                "block_index": None, "token_ids": [], "block_size": 16,
            }  # fmt: skip
            router.send_multipart(
                [identity, b"", b"kvpool", encode_seq(0), encode_batch(time.time(), [stored], 0)]
            )
            router.send_multipart([identity, b"", b"kvpool", encode_seq(END_SEQ), b""])

        with pytest.raises(KvEventsReplayTimeoutError, match="no complete answer"):
            sub.replay(0, timeout_s=0.3)
        assert router.poll(5000)
        first, _, _ = router.recv_multipart()
        answer(first, b"late")  # the answer to the replay the subscriber gave up on

        def serve_next() -> None:  # the next request, answered at once (the router is this thread's now)
            if router.poll(5000):
                identity, _, _ = router.recv_multipart()
                answer(identity, b"fresh")

        server = threading.Thread(target=serve_next)
        server.start()
        try:
            sub.replay(0, timeout_s=5.0)
        finally:
            server.join(10)
        assert set(sub.blocks[GROUP_MLA]) == {b"fresh"} and sub.last_seq == 0

        # an answer that breaks off with a malformed frame: the rest of it must not reach the next replay
        sub.blocks[GROUP_MLA].clear()
        sub.last_seq = -1

        def serve_broken_then_next() -> None:
            if router.poll(5000):
                identity, _, _ = router.recv_multipart()
                router.send_multipart([identity, b"", b"kvpool"])  # three frames where four belong
                answer(identity, b"stale")
            serve_next()

        server = threading.Thread(target=serve_broken_then_next)
        server.start()
        try:
            with pytest.raises(ValueError):
                sub.replay(0, timeout_s=5.0)
            time.sleep(0.2)  # (the stale rest would be in the subscriber's queue by now)
            sub.replay(0, timeout_s=5.0)
        finally:
            server.join(10)
        assert set(sub.blocks[GROUP_MLA]) == {b"fresh"}
    finally:
        sub.close()
        router.close(0)
        ctx.term()
