"""Failure and pressure scenarios through a real cluster: node death, master restart, eviction, read pins."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import threading
import time

import pytest
from kvpool.kvstore.client.sync_client import StoreClient
from kvpool.kvstore.errors import ObjectNotFoundError, StoreUnavailableError, TransportTimeoutError
from kvpool.kvstore.keys import mla_key
from kvpool.kvstore.transport.base import Deadlines
from kvpool.proto import common_pb2
from store_helpers import start_master, start_node

NODE_TIMEOUT_MS = 1200
MASTER_ARGS = ("--heartbeat-ms", "200", "--node-timeout-ms", str(NODE_TIMEOUT_MS))
SLOW_PEER = Deadlines(
    connect_s=2.0, base_s=20.0
)  # long transfer deadline: a quick error must come from the death


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    proc = start_master(tmp_path_factory.mktemp("master"), *MASTER_ARGS)
    yield proc
    proc.stop()


def _holds(predicate) -> bool:
    try:
        return bool(predicate())
    except StoreUnavailableError:  # e.g. the master is still starting
        return False


def wait_for(predicate, timeout: float, step: float = 0.05) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout``."""
    t0 = time.monotonic()
    while not _holds(predicate):
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(step)
    return time.monotonic() - t0


@pytest.mark.parametrize("choice", ["tcp", "shm", "ucx"])
def test_node_killed_mid_get(master, tmp_path, choice):
    """The reader gets a typed error within seconds; the master drops the node's objects in its deadline."""
    node = start_node(tmp_path, master.address, "64MiB")
    try:
        # the reader is a client that never saw the object: c's own shm read hint would be served from the
        # frozen node's generation stamps with no round trip (correctly: the object is still there)
        with (
            StoreClient(master.address, choice, deadlines=SLOW_PEER) as c,
            StoreClient(master.address, choice, deadlines=SLOW_PEER) as fresh,
        ):
            key, data = b"B" + os.urandom(16), os.urandom(8 << 20)
            c.put(key, data)
            assert c.get(key) == data
            os.kill(node.pid, signal.SIGSTOP)  # freeze it so the get is in flight when it dies
            outcome: list = []

            def reader() -> None:
                try:
                    outcome.append(fresh.get(key))
                except Exception as exc:
                    outcome.append(exc)

            t = threading.Thread(target=reader)
            t.start()
            time.sleep(0.5)
            assert not outcome  # still waiting on the frozen node
            killed = time.monotonic()
            os.kill(node.pid, signal.SIGKILL)
            t.join(10)
            assert isinstance(outcome[0], StoreUnavailableError), outcome
            assert time.monotonic() - killed < 3.0
            cleaned = wait_for(lambda: not c.exists(key), NODE_TIMEOUT_MS / 1000 + 3)
            with pytest.raises(ObjectNotFoundError):
                c.get(key)
            print(f"{choice}: error {outcome[0]!r}; index cleaned {cleaned:.2f} s after the failed read")
    finally:
        node.kill()


@pytest.mark.parametrize("choice", ["tcp", "ucx"])
def test_get_from_a_stalled_or_dead_node(tmp_path, choice):
    """A get from a frozen node fails with TransportTimeoutError after ONE transfer deadline; once the
    master has dropped the dead node, a get of another key it held is ObjectNotFoundError, never a timeout
    (a dead node's ucx listener does not refuse: connects time out, and the master's answer decides)."""
    deadlines = Deadlines(connect_s=1.0, base_s=1.0)
    # a master that keeps a silent node for 4 s: the freeze must not look like a death yet
    slow = start_master(tmp_path, "--heartbeat-ms", "200", "--node-timeout-ms", "4000")
    node = start_node(tmp_path, slow.address, "64MiB")
    try:
        with StoreClient(slow.address, choice, deadlines=deadlines) as c:
            stalled, dead = b"B" + os.urandom(16), b"B" + os.urandom(16)
            data = os.urandom(1 << 20)
            c.put(stalled, data)
            c.put(dead, data)
            assert c.get(stalled) == data
            os.kill(node.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(TransportTimeoutError):
                c.get(stalled)
            took = time.monotonic() - t0
            assert took < 1.9, took  # one 1 s deadline plus slack; two would be over 2 s
            os.kill(node.pid, signal.SIGKILL)
            wait_for(lambda: not c.exists(dead), 4 + 3)
            with pytest.raises(ObjectNotFoundError):
                c.get(dead)  # the master says the key is gone
    finally:
        node.kill()
        slow.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_restarted_master_serves_same_objects(tmp_path):
    """Master SIGKILLed and restarted on its address: nodes re-register with inventories, reads work."""
    port = _free_port()
    first = start_master(tmp_path, *MASTER_ARGS, port=port)
    nodes = [start_node(tmp_path, first.address, "32MiB", t) for t in ("tcp,shm,ucx", "tcp")]
    second = None
    try:
        with StoreClient(first.address, "auto") as c:
            objects = {b"B" + os.urandom(16): os.urandom(n) for n in (100, 70_000, 3 << 20, 1 << 20, 999)}
            for key, data in objects.items():
                c.put(key, data)
            first.kill()
            # every call needs the master (a get starts with its Lookup): each fails typed and fast
            known = next(iter(objects))
            with pytest.raises(StoreUnavailableError):
                c.get(known)
            with pytest.raises(StoreUnavailableError):
                c.put(b"B" + os.urandom(16), b"x" * 100)
            second = start_master(tmp_path, *MASTER_ARGS, port=port)
            took = wait_for(lambda: all(c.batch_exists(list(objects))), 10)
            for key, data in objects.items():
                assert c.get(key) == data
            assert c.stats().nodes == 2
            print(f"index rebuilt from inventories {took:.2f} s after the new master was ready")
        with StoreClient(second.address, "tcp") as c:
            assert c.batch_get(list(objects)) == list(objects.values())
    finally:
        for n in nodes:
            n.stop()
        first.kill()
        if second:
            second.stop()


def _chain(tag: bytes, n: int) -> list[bytes]:
    hashes, prev = [], tag
    for _ in range(n):
        prev = hashlib.sha256(prev).digest()
        hashes.append(prev)
    return hashes


def _put_chain(c: StoreClient, hashes: list[bytes], size: int) -> dict[bytes, bytes]:
    blobs, parent = {}, b""
    for h in hashes:
        key, blob = mla_key(h), os.urandom(size)
        c.put(key, blob, kind=common_pb2.MLA_BLOCK, parent=parent)
        blobs[key], parent = blob, key
    return blobs


def test_eviction_under_pressure_keeps_prefix_rule_and_pins(tmp_path):
    """3x the node's capacity through the real cluster: cached chains stay prefixes, pinned blocks stay."""
    master = start_master(tmp_path, *MASTER_ARGS, "--high-watermark", "0.9", "--low-watermark", "0.7")
    node = start_node(tmp_path, master.address, "8MiB", "tcp,shm")
    try:
        with StoreClient(master.address, "auto") as c:
            block = 256 << 10
            system = _chain(b"system", 4)
            blobs = _put_chain(c, system, block)
            assert c.pin([mla_key(h) for h in system], 60_000).pinned == 4
            chains = [_chain(b"user%d" % i, 6) for i in range(16)]
            for hashes in chains:
                blobs |= _put_chain(c, hashes, block)
            assert c.stats().evictions > 0
            assert c.batch_exists([mla_key(h) for h in system]) == [True] * 4
            kept = 0
            for hashes in chains:
                present = c.batch_exists([mla_key(h) for h in hashes])
                run = present.index(False) if False in present else len(present)
                assert not any(present[run:]), f"a suffix outlived its prefix: {present}"
                kept += run
                assert c.match_prefix(hashes, require_checkpoint=False).usable_blocks == run
            assert 0 < kept < 16 * 6
            for key, blob in blobs.items():
                if c.exists(key):
                    assert c.get(key) == blob
    finally:
        node.stop()
        master.stop()


def test_read_pin_protects_object_under_eviction_pressure(tmp_path):
    master = start_master(
        tmp_path, *MASTER_ARGS, "--high-watermark", "0.9", "--low-watermark", "0.7", "--policy", "lru"
    )
    node = start_node(tmp_path, master.address, "8MiB", "tcp,shm")
    try:
        with StoreClient(master.address, "tcp") as c:
            key, data = b"Bpinned" + os.urandom(8), os.urandom(2 << 20)
            c.put(key, data)
            reply = c.lookup([key], acquire=True)
            assert reply.lease_id
            for _ in range(12):  # 12 MiB of newer objects into an 8 MiB node while the lease is held
                c.put(b"B" + os.urandom(16), os.urandom(1 << 20))
            out = bytearray(len(data))
            assert c.fetch_into(list(reply.found), [out]) == [len(data)]
            assert out == data
            c.release(reply.lease_id)
            for _ in range(12):
                c.put(b"B" + os.urandom(16), os.urandom(1 << 20))
            assert not c.exists(key), "once released, the oldest object is the first to go"
    finally:
        node.stop()
        master.stop()


def test_ssd_tier_under_pressure_demotes_and_reads_back(tmp_path):
    """A node with an SSD tier: the master demotes instead of dropping, and every object stays readable."""
    master = start_master(tmp_path, *MASTER_ARGS, "--high-watermark", "0.9", "--low-watermark", "0.6")
    node = start_node(
        tmp_path,
        master.address,
        "4MiB",
        "tcp,shm",
        "--ssd-path",
        str(tmp_path / "ssd"),
        "--ssd-capacity",
        "64MiB",
    )
    try:
        with StoreClient(master.address, "tcp") as c:
            blobs = {b"B" + os.urandom(16): os.urandom(512 << 10) for _ in range(16)}  # 8 MiB into 4 MiB DRAM
            for key, blob in blobs.items():
                c.put(key, blob)
            assert c.stats().demotions > 0
            assert wait_for(lambda: any((tmp_path / "ssd").glob("*.bin")), 5) >= 0
            for key, blob in blobs.items():  # SSD objects are promoted (or served from the file) on read
                assert c.get(key) == blob
    finally:
        node.stop()
        master.stop()


@pytest.mark.slow
def test_node_registers_an_inventory_larger_than_grpc_default_limit(tmp_path):
    """4,600 SSD objects with 1000-byte keys (> 4 MiB of inventory, gRPC's default message cap) adopted."""
    import xxhash
    from kvpool.kvstore.node.object_store import ssd_file_stem

    ssd = tmp_path / "ssd"
    ssd.mkdir()
    n = 4_600
    keys = [b"B" + i.to_bytes(4, "big") + b"k" * 995 for i in range(n)]
    for key in keys:
        blob = key[:8]
        meta = common_pb2.ObjectMeta(
            key=key,
            kind=common_pb2.BLOB,
            size=len(blob),
            tier=common_pb2.SSD,
            checksum=xxhash.xxh3_64_intdigest(blob),
        )
        stem = ssd_file_stem(key)
        (ssd / f"{stem}.bin").write_bytes(blob)
        (ssd / f"{stem}.meta").write_bytes(meta.SerializeToString())
    assert sum(len(k) + 30 for k in keys) > 4 << 20
    master = start_master(tmp_path, *MASTER_ARGS)
    node = start_node(
        tmp_path, master.address, "16MiB", "tcp", "--ssd-path", str(ssd), "--ssd-capacity", "64MiB"
    )
    try:
        with StoreClient(master.address, "tcp") as c:
            assert c.stats().objects == n
            assert c.get(keys[1234]) == keys[1234][:8]
    finally:
        node.stop()
        master.stop()
