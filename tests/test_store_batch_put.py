"""Batched puts through a real master and node: one control exchange each way for a whole push, each bad
item refused on its own and typed, nothing half-written, and a writer killed mid-batch leaves no object."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from kvpool.kvstore.client.async_client import PutItem
from kvpool.kvstore.client.sync_client import StoreClient
from kvpool.kvstore.errors import CapacityExceededError, ObjectExistsError
from kvpool.proto import common_pb2
from store_helpers import start_master, start_node

PUT_DEADLINE_MS = 1500


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    master = start_master(d, "--put-deadline-ms", str(PUT_DEADLINE_MS), "--heartbeat-ms", "200")
    node = start_node(d, master.address, "8MiB", "tcp,shm", prefault=False)
    yield master, node
    node.stop()
    master.stop()


def counters(c: StoreClient) -> dict[str, int]:
    return dict(c.stats().counters)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_one_bad_item_is_refused_typed_and_the_rest_commit(cluster, transport) -> None:
    master, _ = cluster
    good = [(f"{transport}-good-{i}".encode(), os.urandom(64 << 10)) for i in range(3)]
    too_big = (f"{transport}-too-big".encode(), bytes(16 << 20))  # twice the node
    dup = (good[0][0], os.urandom(64 << 10))  # the same key again, other bytes
    with StoreClient(master.address, transport, deadline_s=30) as c:
        before = counters(c)
        got = c.batch_put([PutItem(k, v, common_pb2.BLOB) for k, v in [*good, too_big, dup]])
        assert got[:3] == [None, None, None]
        assert isinstance(got[3], CapacityExceededError) and isinstance(got[4], ObjectExistsError)
        assert "twice in one batch" in str(got[4])
        for k, v in good:
            assert c.get(k) == v  # read-your-writes: committed before batch_put returned
        assert not c.exists(too_big[0])
        after = counters(c)
    assert after["put_batches"] - before.get("put_batches", 0) == 1
    assert after["puts_committed"] - before.get("puts_committed", 0) == 3
    assert after.get("puts_started", 0) - before.get("puts_started", 0) == 3  # nothing else half-started


WRITER = textwrap.dedent(
    """
    import os, sys
    from kvpool.kvstore.client.sync_client import StoreClient
    c = StoreClient(sys.argv[1], "tcp")
    items = [(b"dying-%d" % i, os.urandom(1 << 20)) for i in range(6)]
    print("go", flush=True)
    c.batch_put(items)
    print("done", flush=True)
    """
)


def test_a_writer_killed_mid_batch_leaves_no_object_and_its_puts_are_reaped(cluster) -> None:
    master, _ = cluster
    with StoreClient(master.address, "tcp", deadline_s=10) as c:
        before = counters(c)
    p = subprocess.Popen([sys.executable, "-c", WRITER, master.address], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "go"
    with StoreClient(master.address, "tcp", deadline_s=10) as c:
        end = time.monotonic() + 20
        while counters(c).get("puts_started", 0) == before.get("puts_started", 0):  # its batch has started
            assert time.monotonic() < end and p.poll() is None
            time.sleep(0.002)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
        t0 = time.monotonic()
        while True:
            now = counters(c)
            started = now["puts_started"] - before.get("puts_started", 0)
            finished = sum(
                now.get(k, 0) - before.get(k, 0) for k in ("puts_committed", "puts_abandoned", "puts_aborted")
            )
            if finished == started:
                break
            assert time.monotonic() - t0 < PUT_DEADLINE_MS / 1000 + 5, now
            time.sleep(0.1)
        committed = now.get("puts_committed", 0) - before.get("puts_committed", 0)
        keys = [b"dying-%d" % i for i in range(6)]
        present = [k for k in keys if c.exists(k)]
        # a put is either wholly committed (its bytes arrived before the kill) or gone: never partial
        assert len(present) == committed
        for k in present:
            assert len(c.get(k)) == 1 << 20
