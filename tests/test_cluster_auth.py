"""The cluster secret's two mechanisms in isolation: the raw-connection hello (MAC, freshness, replay) and
the gRPC token, plus how a client follows an HA leader through its master list."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
from kvpool.kvstore.errors import NotLeaderError
from kvpool.kvstore.protocol.master_link import MasterAddresses
from kvpool.runtime import cluster_auth
from kvpool.runtime.cluster_auth import HELLO_SIZE, HelloCheck, hello, load_secret

KEY = b"k" * 32


def test_a_hello_made_with_the_secret_passes_once_and_only_once() -> None:
    check = HelloCheck(KEY, "test", now=lambda: 100000.0)
    msg = hello(KEY, now=lambda: 100000.0)
    assert len(msg) == HELLO_SIZE
    assert check.verify(msg, "a")
    assert not check.verify(msg, "a")  # replayed


@pytest.mark.parametrize(
    "msg",
    [
        hello(b"x" * 32, now=lambda: 100000.0),  # another secret
        hello(KEY, now=lambda: 100000.0 - 3600),  # an hour old
        b"KVP1" + bytes(52),  # a data frame, not a hello
        b"",
    ],
    ids=["wrong-secret", "stale", "a-frame", "nothing"],
)
def test_a_hello_without_the_secret_or_out_of_time_is_refused_and_counted(msg: bytes) -> None:
    before = cluster_auth.rejected.get("test-refuse", 0)
    assert not HelloCheck(KEY, "test-refuse", now=lambda: 100000.0).verify(msg, "peer")
    assert cluster_auth.rejected["test-refuse"] == before + 1


def test_the_secret_comes_from_a_file_or_the_environment_and_must_be_long(tmp_path) -> None:
    f = tmp_path / "s"
    f.write_text("0123456789abcdef0123\n")
    assert load_secret({cluster_auth.ENV_FILE: str(f)}) == b"0123456789abcdef0123"
    assert load_secret({cluster_auth.ENV_VALUE: "y" * 20}) == b"y" * 20
    assert load_secret({}) is None
    with pytest.raises(cluster_auth.ClusterSecretError):
        load_secret({cluster_auth.ENV_VALUE: "short"})
    with pytest.raises(cluster_auth.ClusterSecretError):
        load_secret({cluster_auth.ENV_FILE: str(tmp_path / "missing")})


def test_grpc_calls_without_the_token_are_refused_before_the_handler_runs() -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from kvpool.proto import node_pb2, node_pb2_grpc
    from kvpool.runtime.grpc_server import GrpcServer

    ran: list[str] = []

    class Node(node_pb2_grpc.StorageNodeServicer):
        async def Info(self, request, context):  # type: ignore[no-untyped-def]
            ran.append("Info")
            return node_pb2.NodeInfoReply()

    async def body() -> None:
        cluster_auth.configure(KEY)
        try:
            server = GrpcServer(
                {"n": lambda s: node_pb2_grpc.add_StorageNodeServicer_to_server(Node(), s)}, "127.0.0.1", 0
            )
            port = await server.start()
            address = f"127.0.0.1:{port}"
            async with grpc.aio.insecure_channel(address) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await node_pb2_grpc.StorageNodeStub(ch).Info(node_pb2.NodeInfoRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                health = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert ran == []
            async with cluster_auth.aio_channel(address) as ch:
                await node_pb2_grpc.StorageNodeStub(ch).Info(node_pb2.NodeInfoRequest(), timeout=5)
            assert ran == ["Info"]
            await server.stop(0)
        finally:
            cluster_auth.configure(None)

    asyncio.run(body())


def test_a_client_follows_the_leader_a_standby_names_and_walks_the_list_otherwise() -> None:
    masters = MasterAddresses("a:1,b:2,c:3")
    assert masters.current == "a:1"
    assert masters.follow(NotLeaderError("master a:1 is a standby; leader=c:3").leader)
    assert masters.current == "c:3"
    assert masters.follow(None) and masters.current == "a:1"  # unreachable: the next one
    assert masters.follow("z:9") and masters.current == "b:2"  # a leader not in the list: the next one
    single = MasterAddresses("a:1")
    assert not single.follow("b:2") and single.current == "a:1"
    assert NotLeaderError("master a:1 is read-only (etcd unreachable)").leader is None


def test_a_node_refuses_puts_of_a_leader_older_than_the_newest_it_has_heard() -> None:
    from kvpool.kvstore.errors import StaleEpochError
    from kvpool.kvstore.node.object_store import ObjectStore
    from kvpool.kvstore.node.pool import SharedPool
    from kvpool.proto import common_pb2

    pool = SharedPool(1 << 20)
    try:
        store = ObjectStore(pool)

        def meta(epoch: int) -> common_pb2.ObjectMeta:
            return common_pb2.ObjectMeta(key=b"M" + os.urandom(8), kind=1, size=16, checksum=1, epoch=epoch)

        assert store.begin_put("a", meta(0)) is not None  # no HA: never fenced
        store.fence_of(0).observe(8)  # a leader with epoch 8 answered this node
        with pytest.raises(StaleEpochError):
            store.begin_put("b", meta(2))
        assert store.counters["stale_epoch_refused"] == 1 and "b" not in store.pending
        assert store.begin_put("c", meta(8)) is not None
        fence = store.fence_of(0)
        assert store.begin_put("d", meta(9)) is not None and fence.epoch == 9  # a newer one moves it on
        with pytest.raises(StaleEpochError):
            store.fenced(8, "Delete")
    finally:
        pool.close()
