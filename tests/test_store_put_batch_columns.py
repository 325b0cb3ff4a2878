"""Column-wise PutStartBatch / PutCommitBatch (proto/master.proto) on the master core and its wire server:
each object gets exactly the single call's answer (or its own typed error, by index), columns of one value
apply to every object, and a malformed batch (a column of the wrong length, token counts that do not add
up) is refused whole before anything is started."""

from __future__ import annotations

import asyncio

import pytest
from kvpool.kvstore.errors import (
    BadRequestError,
    CapacityExceededError,
    ObjectExistsError,
    ObjectNotFoundError,
    ShardSetError,
    StoreError,
    WrongShardError,
)
from kvpool.kvstore.master.core import MAX_TENANT_CHARS, MasterConfig, MasterCore
from kvpool.kvstore.master.node_notifier import NodeNotifier
from kvpool.kvstore.master.wire_server import MasterWireServer
from kvpool.kvstore.protocol.master_wire import METHODS, put_start_batch_request
from kvpool.kvstore.shards import ShardSet
from kvpool.proto import common_pb2, master_pb2

from tests.harness.clock import Clock

Reply = master_pb2.PutStartReply
NODE_BYTES = 1 << 20


def _core() -> MasterCore:
    core = MasterCore(MasterConfig(policy="lru"), clock=Clock())
    node = common_pb2.NodeEndpoint(node_id="n", host="127.0.0.1", grpc_port=9)
    core.register_node(master_pb2.RegisterNodeRequest(node=node, dram_capacity_bytes=NODE_BYTES))
    return core


def _meta(key: bytes, size: int = 10, tenant: str = "") -> common_pb2.ObjectMeta:
    return common_pb2.ObjectMeta(key=key, kind=common_pb2.BLOB, size=size, tenant=tenant)


def _seed(core: MasterCore) -> None:
    """One committed object (Bdone) and one put in progress (Bbusy): the answers a batch must reproduce."""
    done = core.put_start(master_pb2.PutStartRequest(meta=_meta(b"Bdone")))
    core.put_commit(master_pb2.PutCommitRequest(put_id=done.put_id))
    core.put_start(master_pb2.PutStartRequest(meta=_meta(b"Bbusy")))


MIXED = [
    _meta(b"Bok1"),
    _meta(b"Bbig", size=2 * NODE_BYTES),  # no node can hold it
    _meta(b"Bdone"),  # committed: EXISTS
    _meta(b"Bbusy"),  # being put: IN_PROGRESS
    _meta(b"Btenant", tenant="t" * (MAX_TENANT_CHARS + 1)),
    _meta(b"Bok1"),  # the same key twice in one batch: the second is refused
    common_pb2.ObjectMeta(key=b"Bkind", kind=common_pb2.MLA_BLOCK, size=10),  # kind disagrees with the key
    _meta(b"Bok2"),
]


def test_each_object_gets_the_single_calls_answer_and_errors_name_their_index() -> None:
    batch_core, single_core = _core(), _core()
    _seed(batch_core)
    _seed(single_core)
    reply = batch_core.put_start_batch(put_start_batch_request(MIXED))
    errors = {e.index: e for e in reply.errors}
    assert len(reply.status) == len(reply.put_ids) == len(reply.node) == len(MIXED)
    assert sorted(errors) == [1, 4, 5, 6]
    assert errors[1].code == CapacityExceededError.code
    assert errors[4].code == BadRequestError.code and "tenant" in errors[4].message
    assert errors[5].code == ObjectExistsError.code and "twice in one batch" in errors[5].message
    assert errors[6].code == BadRequestError.code
    for i, meta in enumerate(MIXED):  # the same object as a single PutStart, in the same order
        if i == 5:
            continue  # a batch-only answer
        try:
            single = single_core.put_start(master_pb2.PutStartRequest(meta=meta))
        except StoreError as exc:
            assert i in errors and errors[i].code == exc.code and reply.status[i] == 0
            assert errors[i].message == f"{type(exc).__name__}: {exc}"
            continue
        assert i not in errors and reply.status[i] == single.status
        assert bool(reply.put_ids[i]) == bool(single.put_id)
        assert reply.nodes[reply.node[i]] == single.node
    assert [reply.status[i] for i in (0, 2, 3, 7)] == [
        Reply.STARTED,
        Reply.EXISTS,
        Reply.IN_PROGRESS,
        Reply.STARTED,
    ]
    assert reply.deadline_ms == batch_core.config.put_deadline_ms and len(reply.nodes) == 1
    counted = batch_core.counters
    assert (counted["puts_started"], counted["puts_exist"], counted["puts_in_progress"]) == (
        2 + 2,
        1,
        1,
    )  # the seed + the batch


def test_a_column_of_one_value_applies_to_every_object() -> None:
    core = _core()
    request = master_pb2.PutStartBatchRequest(
        keys=[b"Ba", b"Bb", b"Bc"], kinds=[common_pb2.BLOB], sizes=[7], tenants=["acme"], ttl_ms=[60_000]
    )
    reply = core.put_start_batch(request)
    assert list(reply.status) == [Reply.STARTED] * 3 and not reply.errors
    core.put_commit_batch(master_pb2.PutCommitBatchRequest(put_ids=reply.put_ids))
    found = core.lookup(master_pb2.LookupRequest(keys=[b"Ba", b"Bb", b"Bc"])).found
    assert [(f.meta.size, f.meta.tenant, f.meta.ttl_ms) for f in found] == [(7, "acme", 60_000)] * 3


@pytest.mark.parametrize(
    ("columns", "why"),
    [
        ({"sizes": [10, 10]}, "2 sizes for 3 keys"),
        ({"sizes": [10], "tenants": ["a", "b"]}, "2 tenants for 3 keys"),
        ({"sizes": [10], "parents": [b"", b"", b"", b""]}, "4 parents for 3 keys"),
        ({"sizes": [10], "token_ids": [1, 2, 3], "token_counts": [1, 1, 2]}, "add up to 4"),
        ({"sizes": [10], "token_ids": [1, 2]}, "without token_counts"),
    ],
)
def test_a_malformed_batch_is_refused_whole_and_starts_nothing(columns: dict, why: str) -> None:
    core = _core()
    before = (len(core.index), core.stats().pending_puts, dict(core.counters))
    request = master_pb2.PutStartBatchRequest(keys=[b"Bx", b"By", b"Bz"], kinds=[common_pb2.BLOB], **columns)
    with pytest.raises(BadRequestError, match=why):
        core.put_start_batch(request)
    assert (len(core.index), core.stats().pending_puts, dict(core.counters)) == before
    assert core.put_start_batch(put_start_batch_request([_meta(b"Bx")])).status[0] == Reply.STARTED


def test_a_commit_batch_answers_only_its_failures_by_index() -> None:
    core = _core()
    started = core.put_start_batch(
        put_start_batch_request([_meta(b"B1"), _meta(b"B2")], checksum_at_commit=True)
    )
    ids = [started.put_ids[0], "no-such-put", started.put_ids[1]]
    with pytest.raises(BadRequestError, match="2 checksums for 3 put ids"):
        core.put_commit_batch(master_pb2.PutCommitBatchRequest(put_ids=ids, checksums=[5, 6]))
    reply = core.put_commit_batch(master_pb2.PutCommitBatchRequest(put_ids=ids, checksums=[5, 6, 0]))
    # an unknown put, and B2 owing its checksum (checksum_at_commit): each refused on its own
    assert [(e.index, e.code) for e in reply.errors] == [
        (1, ObjectNotFoundError.code),
        (2, BadRequestError.code),
    ]
    found = core.lookup(master_pb2.LookupRequest(keys=[b"B1", b"B2"])).found
    assert [(f.meta.key, f.meta.checksum) for f in found] == [(b"B1", 5)]
    again = core.put_commit_batch(
        master_pb2.PutCommitBatchRequest(put_ids=[started.put_ids[1]], checksums=[9])
    )
    assert not again.errors and core.stats().pending_puts == 0
    assert core.counters["puts_committed"] == 2


def test_the_wire_server_holds_a_started_put_behind_a_queued_delete_of_its_key() -> None:
    """A column batch's started objects are matched with their node (``node`` -> ``nodes``) to find a delete
    of the same key still queued for that node; the reply waits for it (wire_server._deletes_first)."""

    async def run() -> list[asyncio.Future[None]]:
        core = _core()
        notifier = NodeNotifier(1.0, lambda name, n: None)
        queued = asyncio.get_running_loop().create_future()
        notifier.deletes_queued = lambda: True  # type: ignore[method-assign]
        notifier.delete_pending = lambda node_id, key: queued if (node_id, key) == ("n", b"B2") else None  # type: ignore[method-assign]
        server = MasterWireServer(core, notifier)
        body = put_start_batch_request([_meta(b"B1"), _meta(b"Bbig", size=2 * NODE_BYTES), _meta(b"B2")])
        reply, after = server.run(METHODS["PutStartBatch"], body.SerializeToString())
        assert [e.index for e in master_pb2.PutStartBatchReply.FromString(reply).errors] == [1]
        return [f is queued for f in after]

    assert asyncio.run(run()) == [True]


def test_a_sharded_batch_checks_each_route_and_its_shard_set() -> None:
    """Each object is refused on its own when its route belongs to another shard (a route is checked once
    per batch, its objects answered alike); the writer's shard set is compared as this master spells it,
    and parsed when spelled otherwise."""
    shards = ShardSet(2)
    core = MasterCore(MasterConfig(policy="lru", shards=shards, shard=0), clock=Clock())
    node = common_pb2.NodeEndpoint(node_id="n", host="127.0.0.1", grpc_port=9)
    core.register_node(
        master_pb2.RegisterNodeRequest(node=node, dram_capacity_bytes=NODE_BYTES, shard_set=str(shards))
    )
    routes = [bytes([i]) * 32 for i in range(16)]
    mine = next(r for r in routes if shards.shard_of_route(r) == 0)
    theirs = next(r for r in routes if shards.shard_of_route(r) == 1)
    metas = [_meta(b"B%d" % i) for i in range(4)]
    request = put_start_batch_request(metas, routes=[mine, theirs, mine, theirs], shard_set=str(shards))
    reply = core.put_start_batch(request)
    assert [(e.index, e.code) for e in reply.errors] == [(1, WrongShardError.code), (3, WrongShardError.code)]
    assert [reply.status[i] for i in (0, 2)] == [Reply.STARTED, Reply.STARTED]
    request.shard_set = f"{shards.count}"  # the same set, spelled without its depth
    request.keys[:] = [b"Bx", b"By", b"Bz", b"Bw"]
    assert len(core.put_start_batch(request).errors) == 2
    request.shard_set = "3x2"
    with pytest.raises(ShardSetError):
        core.put_start_batch(request)
