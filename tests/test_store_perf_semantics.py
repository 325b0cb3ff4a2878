"""What a client sees when others change the store under it: a get after another client removed or replaced
the key answers the current object; a duplicate shm put leaves nothing reserved on the node."""

from __future__ import annotations

import os

import pytest
from kvpool.kvstore.client.sync_client import StoreClient
from kvpool.kvstore.errors import ObjectNotFoundError
from store_helpers import start_master, start_node


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("perf-cluster")
    master = start_master(logs, "--heartbeat-ms", "200", "--node-timeout-ms", "1500")
    node = start_node(logs, master.address, "64MiB", "tcp,shm")
    yield master, node
    node.stop()
    master.stop()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_get_after_a_remove_or_replace_answers_the_current_object(cluster, transport) -> None:
    master, _node = cluster
    key = f"perf/{transport}/{os.urandom(4).hex()}".encode()
    first, second = os.urandom(300_000), os.urandom(200_000)
    with StoreClient(master.address, transport) as a, StoreClient(master.address, transport) as b:
        assert a.put(key, first) is True
        assert a.get(key) == first
        # removed by someone else: a's next get must not find it, not even for a moment
        assert b.remove([key]) == 1
        with pytest.raises(ObjectNotFoundError):
            a.get(key)
        with pytest.raises(ObjectNotFoundError):
            a.get_into(key, bytearray(len(first)))
        # replaced by someone else with other bytes: a gets the new object, never the old one
        assert a.put(key, first) is True
        assert b.remove([key]) == 1
        assert b.put(key, second) is True
        out = bytearray(len(second))
        assert a.get_into(key, out) == len(second) and out == second
        assert a.get(key) == second


def test_a_duplicate_shm_put_leaves_nothing_reserved(cluster) -> None:
    import grpc
    from kvpool.proto import node_pb2, node_pb2_grpc

    master, node = cluster
    data = os.urandom(100_000)
    key = f"perf/dup/{os.urandom(4).hex()}".encode()

    def dram_used() -> int:
        with grpc.insecure_channel(node.grpc_target) as ch:
            reply = node_pb2_grpc.StorageNodeStub(ch).Info(node_pb2.NodeInfoRequest(), timeout=5)
        return reply.dram_used_bytes

    with StoreClient(master.address, "shm") as c:
        assert c.put(key, data) is True
        used = dram_used()
        assert c.put(key, data) is False  # EXISTS at the master: nothing stays reserved
        assert dram_used() == used
        assert c.get(key) == data
