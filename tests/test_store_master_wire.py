"""Master wire (kvstore/master_wire*.py) and MasterLink (kvstore/client/master_link.py) against real masters.

A master child process (``kvpool store master``, readiness line) for the protocol and failure cases; an
in-process ``MasterServer`` on the test's loop where the test must control the listener itself (a frame
deadline short enough to test, a wire port taken over by a peer that hangs up, a restart on one port).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpool.kvstore.client.master_link import SILENT_BACKOFF_S, MasterLink, host_of
from kvpool.kvstore.client.master_wire import MasterWireClient
from kvpool.kvstore.errors import (
    BadRequestError,
    CapacityExceededError,
    MasterSilentError,
    ObjectNotFoundError,
    StoreUnavailableError,
    TransportTimeoutError,
)
from kvpool.kvstore.keys import mla_key
from kvpool.kvstore.master.config import MasterConfig
from kvpool.kvstore.master.core import MasterCore
from kvpool.kvstore.master.dispatch import CoreCallError, CoreDispatch
from kvpool.kvstore.master.node_notifier import NodeNotifier
from kvpool.kvstore.master.server import MasterServer
from kvpool.kvstore.master.wire_server import MasterWireServer
from kvpool.kvstore.protocol.master_wire import HEADER, MAGIC, MAX_BODY, METHODS, WireConnectError
from kvpool.proto import common_pb2, master_pb2

from tests.harness.master_proc import MasterProcess, ProbeNode
from tests.harness.store_procs import start_master

T = 5.0
Cluster = tuple[MasterProcess, ProbeNode]
HOT = {"PutStart", "PutCommit", "PutAbort", "Lookup", "Release", "MatchPrefix", "Remove", "Pin", "Stats"}


def key(i: int, tag: bytes = b"w") -> bytes:
    return b"M" + tag * 8 + i.to_bytes(24, "little")


def meta(k: bytes, parent: bytes = b"", kind: int = common_pb2.MLA_BLOCK) -> common_pb2.ObjectMeta:
    return common_pb2.ObjectMeta(key=k, kind=kind, size=4096, checksum=7, parent=parent)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A master child process and a probe node (a real gRPC node endpoint recording the master's orders)."""
    m = MasterProcess(tmp_path_factory.mktemp("wire-master"))
    node = ProbeNode("wire-node", m, dram=1 << 30)
    node.register()
    node.start_heartbeats()
    yield m, node
    node.close()
    m.terminate()


@pytest.fixture(scope="module")
def master(cluster: Cluster) -> MasterProcess:
    return cluster[0]


async def _put(link: MasterLink, m: common_pb2.ObjectMeta) -> None:
    start = await link.call("PutStart", master_pb2.PutStartRequest(meta=m))
    assert start.status == master_pb2.PutStartReply.STARTED
    await link.call("PutCommit", master_pb2.PutCommitRequest(put_id=start.put_id))


def test_method_table_covers_the_hot_calls() -> None:
    assert set(METHODS) >= HOT
    assert len({m.method_id for m in METHODS.values()}) == len(METHODS)
    for m in METHODS.values():
        assert callable(getattr(MasterCore, m.core_method)), m.name
        assert m.request.DESCRIPTOR.full_name == f"kvpool.v1.{m.name}Request"
        assert m.reply.DESCRIPTOR.full_name == f"kvpool.v1.{m.name}Reply"


def test_readiness_line_and_describe_report_the_wire_port(tmp_path: Path) -> None:
    proc = start_master(tmp_path)
    try:

        async def run() -> master_pb2.DescribeReply:
            async with MasterLink(proc.address) as link:
                return await link.describe()

        reply = asyncio.run(run())
        assert isinstance(proc.ready["wire_port"], int) and proc.ready["wire_port"] > 0
        assert reply.wire_port == proc.ready["wire_port"] and reply.instance
        assert set(reply.wire_methods) >= HOT
    finally:
        assert proc.stop() == 0


def test_every_method_round_trips_and_equals_the_grpc_answer(cluster: Cluster) -> None:
    master, node = cluster

    async def run() -> None:
        async with MasterLink(master.address) as wire, MasterLink(master.address, use_wire=False) as grpc_:

            async def both(name: str, via_grpc: object, via_wire: object) -> tuple[object, object]:
                return await grpc_.call(name, via_grpc), await wire.call(name, via_wire)

            a, b, c, d = key(1), key(2), key(3), key(4)
            g, w = await both(
                "PutStart", master_pb2.PutStartRequest(meta=meta(a)), master_pb2.PutStartRequest(meta=meta(b))
            )
            assert g.status == w.status == master_pb2.PutStartReply.STARTED and g.put_id != w.put_id
            assert (g.node, g.deadline_ms) == (w.node, w.deadline_ms)
            pc = await both(
                "PutCommit",
                master_pb2.PutCommitRequest(put_id=g.put_id),
                master_pb2.PutCommitRequest(put_id=w.put_id),
            )
            assert pc[0] == pc[1]
            g, w = await both(
                "PutStart", master_pb2.PutStartRequest(meta=meta(c)), master_pb2.PutStartRequest(meta=meta(d))
            )
            pa = await both(  # each channel aborts the put the other one started
                "PutAbort",
                master_pb2.PutAbortRequest(put_id=w.put_id, reason="t"),
                master_pb2.PutAbortRequest(put_id=g.put_id, reason="t"),
            )
            assert pa[0] == pa[1]
            lookup = master_pb2.LookupRequest(keys=[a, b, c, d])
            g, w = await both("Lookup", lookup, lookup)
            assert g == w and [f.meta.key for f in w.found] == [a, b] and list(w.missing) == [c, d]
            acquire = master_pb2.LookupRequest(keys=[a], acquire=True)
            g, w = await both("Lookup", acquire, acquire)
            assert g.found == w.found and g.lease_id and w.lease_id and g.lease_id != w.lease_id
            rel = await both(
                "Release",
                master_pb2.ReleaseRequest(lease_id=w.lease_id),
                master_pb2.ReleaseRequest(lease_id=g.lease_id),
            )
            assert rel[0] == rel[1]

            hashes = [bytes([i]) * 32 for i in range(1, 6)]
            parent = b""
            for h in hashes:
                await _put(wire, meta(mla_key(h), parent))
                parent = mla_key(h)
            for compact in (False, True):
                match = master_pb2.MatchPrefixRequest(block_hashes=hashes, compact=compact)
                g, w = await both("MatchPrefix", match, match)
                assert g == w and w.usable_blocks == len(hashes)
            pin = master_pb2.PinRequest(keys=[a, c], ttl_ms=60_000)
            g, w = await both("Pin", pin, pin)
            assert g == w and w.pinned == 1
            quota = master_pb2.SetQuotaRequest(tenant="t-wire", max_bytes=1 << 40)
            g, w = await both("SetQuota", quota, quota)
            assert g == w
            g, w = await both("Stats", master_pb2.StatsRequest(), master_pb2.StatsRequest())
            g.ClearField("counters")  # the calls themselves are counted
            w.ClearField("counters")
            assert g == w and w.objects >= 2 + len(hashes)
            g, w = await both(
                "Remove", master_pb2.RemoveRequest(keys=[a]), master_pb2.RemoveRequest(keys=[b, key(99)])
            )
            assert g == w and w.removed == 1
            assert {a, b} <= set(node.orders("delete"))  # answered only after the node was told (as gRPC)
            assert wire.counters.get("grpc_calls", 0) == 0 and wire.counters["wire_calls"] >= 14
            assert grpc_.wire is None and "wire_calls" not in grpc_.counters

    asyncio.run(run())


def test_errors_are_the_same_typed_errors_as_grpc(master: MasterProcess) -> None:
    async def run() -> None:
        async with MasterLink(master.address) as wire, MasterLink(master.address, use_wire=False) as grpc_:
            cases = [
                ("Lookup", master_pb2.LookupRequest(keys=[b""]), BadRequestError),
                ("PutCommit", master_pb2.PutCommitRequest(put_id="nope:1"), ObjectNotFoundError),
                ("Release", master_pb2.ReleaseRequest(lease_id="garbage"), BadRequestError),
                ("Pin", master_pb2.PinRequest(keys=[key(1)], ttl_ms=1 << 31), BadRequestError),
                ("MatchPrefix", master_pb2.MatchPrefixRequest(block_hashes=[b"short"]), BadRequestError),
            ]
            for name, request, expected in cases:
                with pytest.raises(expected) as via_grpc:
                    await grpc_.call(name, request)
                with pytest.raises(expected) as via_wire:
                    await wire.call(name, request)
                assert type(via_wire.value) is type(via_grpc.value), name
                assert str(via_wire.value) == str(via_grpc.value), name
            assert wire.counters == {"describes": 1, "wire_calls": len(cases)}  # all answered over the wire
            assert await wire.call("Stats", master_pb2.StatsRequest())  # the connection survived them

    asyncio.run(run())


def test_pipelined_concurrent_calls_are_answered_by_request_id(master: MasterProcess) -> None:
    async def run() -> None:
        async with MasterLink(master.address) as link:
            keys = [key(i, b"p") for i in range(20)]
            for k in keys:
                await _put(link, meta(k))
            port = (await link.describe()).wire_port
        client = MasterWireClient("127.0.0.1", port)
        try:
            await client.call("Stats", master_pb2.StatsRequest(), T)  # connected
            requests = [
                master_pb2.LookupRequest(keys=[keys[i % 20], key(1000 + i, b"p")]) for i in range(200)
            ]
            calls = [asyncio.ensure_future(client.call("Lookup", r, T)) for r in requests]
            await asyncio.sleep(0)  # every call has been written before any reply could be read
            assert client.in_flight == 200
            replies = await asyncio.gather(*calls)
            for i, reply in enumerate(replies):
                assert [f.meta.key for f in reply.found] == [keys[i % 20]]
                assert list(reply.missing) == [key(1000 + i, b"p")]
            assert client.in_flight == 0
        finally:
            await client.close()

    asyncio.run(run())


def _closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    sock.settimeout(timeout_s)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize(
    "junk",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        HEADER.pack(MAGIC, 4, 0, 0, 1, MAX_BODY + 1),  # oversized length
        HEADER.pack(MAGIC, 200, 0, 0, 1, 0),  # unknown method
        HEADER.pack(b"KVP1", 4, 0, 0, 1, 0),  # another protocol's magic
        HEADER.pack(MAGIC, 4, 3, 0, 1, 0),  # a request carrying a status
    ],
    ids=["garbage", "oversized", "unknown-method", "bad-magic", "request-with-status"],
)
def test_bad_frames_close_the_connection_and_the_server_keeps_serving(
    master: MasterProcess, junk: bytes
) -> None:
    async def port() -> int:
        async with MasterLink(master.address) as link:
            return (await link.describe()).wire_port

    wire_port = asyncio.run(port())
    with socket.create_connection(("127.0.0.1", wire_port), timeout=T) as sock:
        sock.sendall(junk)
        assert _closed_by_peer(sock, T)

    async def fresh_client_works() -> None:
        client = MasterWireClient("127.0.0.1", wire_port)
        try:
            assert (await client.call("Stats", master_pb2.StatsRequest(), T)).policy == "hybrid"
        finally:
            await client.close()

    asyncio.run(fresh_client_works())


def test_undecodable_body_is_a_bad_request_on_a_connection_that_keeps_working(master: MasterProcess) -> None:
    async def run() -> None:
        async with MasterLink(master.address) as link:
            wire_port = (await link.describe()).wire_port
        reader, writer = await asyncio.open_connection("127.0.0.1", wire_port)
        try:
            body = b"\xff\xff\xff"
            writer.write(HEADER.pack(MAGIC, METHODS["Lookup"].method_id, 0, 0, 41, len(body)) + body)
            stats = master_pb2.StatsRequest().SerializeToString()
            writer.write(HEADER.pack(MAGIC, METHODS["Stats"].method_id, 0, 0, 42, len(stats)) + stats)
            got = {}
            for _ in range(2):
                _magic, _method, status, _r, rid, n = HEADER.unpack(
                    await asyncio.wait_for(reader.readexactly(20), T)
                )
                got[rid] = (status, await asyncio.wait_for(reader.readexactly(n), T))
            assert got[41][0] == 3 and b"undecodable" in got[41][1]  # INVALID_ARGUMENT
            assert got[42][0] == 0 and master_pb2.StatsReply.FromString(got[42][1]).policy == "hybrid"
        finally:
            writer.close()

    asyncio.run(run())


def test_dispatch_turns_a_bug_into_internal_and_counts_it() -> None:
    core = MasterCore(MasterConfig())
    dispatch = CoreDispatch(core, NodeNotifier(1.0, core.count))

    def broken(_request: object) -> None:
        raise ZeroDivisionError("boom")

    core.broken = broken  # type: ignore[attr-defined]
    with pytest.raises(CoreCallError) as err:
        dispatch.run("broken", master_pb2.StatsRequest())
    assert err.value.code == "INTERNAL" and err.value.message == "ZeroDivisionError: boom"
    with pytest.raises(CoreCallError) as err:
        dispatch.run("lookup", master_pb2.LookupRequest(keys=[b""]))
    assert err.value.code == "INVALID_ARGUMENT"
    assert core.counters["rpc_internal"] == 1 and core.counters["rpc_invalid_argument"] == 1
    reply, wait_for = dispatch.run("stats", master_pb2.StatsRequest())
    assert reply.policy == "hybrid" and wait_for == []


def test_truncated_frame_is_closed_at_the_frame_deadline() -> None:
    async def run() -> None:
        server = MasterServer(MasterConfig(wire_port=-1))
        await server.start()
        wire = MasterWireServer(server.dispatch, frame_timeout_s=0.3)
        port = await wire.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(HEADER.pack(MAGIC, METHODS["Lookup"].method_id, 0, 0, 1, 100) + b"\0" * 10)
            t0 = time.monotonic()
            assert await asyncio.wait_for(reader.read(), T) == b""  # EOF: the server hung up
            assert 0.25 <= time.monotonic() - t0 < 2.0
            writer.close()
            for partial in (b"KVM", HEADER.pack(MAGIC, 4, 0, 0, 1, 8)[:12]):  # a header cut short too
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(partial)
                assert await asyncio.wait_for(reader.read(), T) == b""
                writer.close()
            client = MasterWireClient("127.0.0.1", port)
            assert (await client.call("Stats", master_pb2.StatsRequest(), T)).counters[
                "wire_frame_timeouts"
            ] == 3
            await client.close()
        finally:
            await wire.close()
            await server.stop(0)

    asyncio.run(run())


def test_a_reply_over_the_size_limit_is_refused_not_a_dropped_connection() -> None:
    async def run() -> None:
        server = MasterServer(MasterConfig(wire_port=-1))
        await server.start()
        wire = MasterWireServer(server.dispatch, max_body=4096)
        client = MasterWireClient("127.0.0.1", await wire.start("127.0.0.1", 0))
        try:
            core = server.core
            node = common_pb2.NodeEndpoint(node_id="n1", host="127.0.0.1", grpc_port=9, tcp_port=9)
            core.register_node(master_pb2.RegisterNodeRequest(node=node, dram_capacity_bytes=1 << 30))
            keys = [key(i, b"z") for i in range(80)]
            for k in keys:
                put = core.put_start(master_pb2.PutStartRequest(meta=meta(k)))
                core.put_commit(master_pb2.PutCommitRequest(put_id=put.put_id))
            lookup = master_pb2.LookupRequest(keys=keys)
            assert lookup.ByteSize() < 4096 < core.lookup(lookup).ByteSize()
            with pytest.raises(CapacityExceededError, match="RESOURCE_EXHAUSTED"):
                await client.call("Lookup", lookup, T)
            assert (await client.call("Stats", master_pb2.StatsRequest(), T)).policy == "hybrid"
        finally:
            await client.close()
            await wire.close()
            await server.stop(0)

    asyncio.run(run())


def test_killed_master_fails_in_flight_and_new_calls_fast(tmp_path: Path) -> None:
    m = MasterProcess(tmp_path)

    async def run() -> None:
        async with MasterLink(m.address) as link:
            wire_port = (await link.describe()).wire_port
        client = MasterWireClient("127.0.0.1", wire_port, connect_timeout_s=1.0)
        try:
            await client.call("Stats", master_pb2.StatsRequest(), T)
            os.kill(m.proc.pid, signal.SIGSTOP)  # the next call is sent and never answered...
            call = asyncio.ensure_future(client.call("Stats", master_pb2.StatsRequest(), 30.0))
            await asyncio.sleep(0.2)
            assert client.in_flight == 1 and not call.done()
            t0 = time.monotonic()
            os.kill(m.proc.pid, signal.SIGKILL)  # ...until the master dies
            with pytest.raises(StoreUnavailableError) as err:
                await call
            assert not isinstance(err.value, TransportTimeoutError)
            assert time.monotonic() - t0 < 2.0
            m.proc.wait(timeout=T)  # (while the kernel tears the process down a connect may still succeed)
            t0 = time.monotonic()
            with pytest.raises(WireConnectError):  # the next call reconnects and finds nobody
                await client.call("Stats", master_pb2.StatsRequest(), 30.0)
            assert time.monotonic() - t0 < 2.0
        finally:
            await client.close()

    try:
        asyncio.run(run())
    finally:
        m.kill()


def test_client_reconnects_after_the_listener_restarts() -> None:
    async def run() -> None:
        server = MasterServer(MasterConfig())
        await server.start()
        port = server.wire_port
        client = MasterWireClient("127.0.0.1", port)
        try:
            await client.call("Stats", master_pb2.StatsRequest(), T)
            assert server.wire is not None
            await server.wire.close()
            with pytest.raises(StoreUnavailableError):
                await client.call("Stats", master_pb2.StatsRequest(), T)
            await server.wire.start("127.0.0.1", port)
            assert (await client.call("Stats", master_pb2.StatsRequest(), T)).policy == "hybrid"
        finally:
            await client.close()
            await server.stop(0)

    asyncio.run(run())


def test_link_uses_grpc_when_the_wire_is_off(tmp_path: Path) -> None:
    m = MasterProcess(tmp_path, "--wire-port", "-1")

    async def run() -> None:
        async with MasterLink(m.address) as link:
            assert (await link.describe()).wire_port == 0
            reply = await link.call("Lookup", master_pb2.LookupRequest(keys=[key(5)]))
            assert list(reply.missing) == [key(5)]
            with pytest.raises(BadRequestError):
                await link.call("Lookup", master_pb2.LookupRequest(keys=[b""]))
            assert link.wire is None and link.counters == {"describes": 1, "grpc_calls": 2}

    try:
        asyncio.run(run())
    finally:
        m.terminate()


def test_link_retries_only_idempotent_calls_over_grpc_when_the_wire_breaks() -> None:
    """The advertised wire port is taken over by a peer that reads the request and hangs up: the call was
    sent and its outcome is unknown. A Lookup is retried over gRPC; a PutStart must fail, not run twice."""

    async def run() -> None:
        server = MasterServer(MasterConfig())
        await server.start()
        node = common_pb2.NodeEndpoint(node_id="n1", host="127.0.0.1", grpc_port=9, tcp_port=9)
        server.core.register_node(master_pb2.RegisterNodeRequest(node=node, dram_capacity_bytes=1 << 30))
        assert server.wire is not None
        port = server.wire_port
        await server.wire.close()

        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(20)
            writer.transport.abort()

        impostor = await asyncio.start_server(hang_up, "127.0.0.1", port)
        link = MasterLink(f"127.0.0.1:{server.port}")
        try:
            reply = await link.call("Lookup", master_pb2.LookupRequest(keys=[key(7)]))
            assert list(reply.missing) == [key(7)] and link.counters["wire_retried_over_grpc"] == 1
            with pytest.raises(StoreUnavailableError) as err:
                await link.call("PutStart", master_pb2.PutStartRequest(meta=meta(key(8))))
            assert type(err.value) is StoreUnavailableError
            assert server.core.stats().pending_puts == 0  # it never reached the master
            impostor.close()
            await impostor.wait_closed()
            # nothing listens on the wire port now: a refused connection sent nothing, so even a PutStart
            # goes over gRPC (after a fresh Describe)
            start = await link.call("PutStart", master_pb2.PutStartRequest(meta=meta(key(8))))
            assert start.status == master_pb2.PutStartReply.STARTED
            assert link.counters["wire_unreachable"] == 1 and server.core.stats().pending_puts == 1
            describes, grpc_calls = link.counters["describes"], link.counters["grpc_calls"]
            await link.call("Lookup", master_pb2.LookupRequest(keys=[key(7)]))  # within the 1 s backoff:
            assert link.counters["describes"] == describes  # gRPC, no Describe, no connect attempt
            assert link.counters["grpc_calls"] == grpc_calls + 1 and link.counters["wire_unreachable"] == 1
        finally:
            await link.close()
            await server.stop(0)

    asyncio.run(run())


def test_an_unreachable_wire_port_costs_a_batch_one_connect_timeout() -> None:
    """The advertised port accepts no connection (a full backlog: SYNs are dropped, as behind a firewall).
    A gathered batch shares one connect attempt and then goes over gRPC, all within ~one connect timeout."""

    async def run() -> None:
        server = MasterServer(MasterConfig())
        await server.start()
        assert server.wire is not None
        port = server.wire_port
        await server.wire.close()
        hole = socket.socket()
        hole.bind(("127.0.0.1", port))
        hole.listen(0)
        fillers = []
        for _ in range(4):  # fill the accept queue; later SYNs go unanswered
            f = socket.socket()
            f.setblocking(False)
            f.connect_ex(("127.0.0.1", port))
            fillers.append(f)
        link = MasterLink(f"127.0.0.1:{server.port}", rpc_timeout_s=T, connect_timeout_s=0.3)
        try:
            await link.describe()
            t0 = time.monotonic()
            replies = await asyncio.gather(
                *(link.call("Lookup", master_pb2.LookupRequest(keys=[key(i, b"u")])) for i in range(50))
            )
            assert time.monotonic() - t0 < 2.0
            assert all(list(r.missing) == [key(i, b"u")] for i, r in enumerate(replies))
            assert link.counters["wire_unreachable"] == 50 and link.counters["grpc_calls"] == 50
            assert link.counters["describes"] == 1
        finally:
            await link.close()
            for s in (*fillers, hole):
                s.close()
            await server.stop(0)

    asyncio.run(run())


def test_a_silent_master_opens_the_breaker_calls_fail_fast_and_a_background_probe_closes_it(
    master: MasterProcess,
) -> None:
    """A frozen master costs one deadline, not one per call: the calls after it fail in microseconds with
    ``MasterSilentError`` (counted) while a background probe asks the master; its first answer closes the
    breaker, and no caller ever waited for the probe."""

    async def run() -> None:
        async with MasterLink(master.address, rpc_timeout_s=0.5) as link:
            await link.call("Stats", master_pb2.StatsRequest())
            os.kill(master.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(TransportTimeoutError):
                    await link.call("Stats", master_pb2.StatsRequest())
                assert link.silent
                t0 = time.monotonic()
                for _ in range(20):
                    with pytest.raises(MasterSilentError):
                        await link.call("Lookup", master_pb2.LookupRequest(keys=[key(1, b"x")]))
                assert time.monotonic() - t0 < 0.05
                await asyncio.sleep(3 * SILENT_BACKOFF_S[0] + 0.6)  # probes time out meanwhile
                assert link.silent and link.counters["probes"] >= 1
                assert link.counters["failed_fast"] == 20 and link.counters["silent"] == 1
            finally:
                os.kill(master.proc.pid, signal.SIGCONT)
            t0 = time.monotonic()
            while link.silent:
                assert time.monotonic() - t0 < SILENT_BACKOFF_S[1] + 1.5, "the probe never closed the breaker"
                await asyncio.sleep(0.02)
            assert isinstance(await link.call("Stats", master_pb2.StatsRequest()), master_pb2.StatsReply)

    asyncio.run(run())


def test_link_timeouts_are_typed_and_bounded(master: MasterProcess) -> None:
    async def run() -> None:
        async with MasterLink(master.address, rpc_timeout_s=0.5) as link:
            await link.call("Stats", master_pb2.StatsRequest())
            os.kill(master.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                with pytest.raises(TransportTimeoutError):
                    await link.call("PutStart", master_pb2.PutStartRequest(meta=meta(key(9, b"t"))))
            finally:
                os.kill(master.proc.pid, signal.SIGCONT)
            assert time.monotonic() - t0 < 1.5
            while link.silent:  # the breaker's probe gets an answer from the thawed master
                await asyncio.sleep(0.02)
            assert isinstance(await link.call("Stats", master_pb2.StatsRequest()), master_pb2.StatsReply)

    asyncio.run(run())


def test_host_of_addresses() -> None:
    assert host_of("127.0.0.1:50051") == "127.0.0.1"
    assert host_of("kvpool-master:50051") == "kvpool-master"
    assert host_of("[::1]:50051") == "::1"
    assert host_of("dns:///master.svc:50051") == "master.svc"


def test_a_send_blocked_by_a_stalled_master_ends_at_the_deadline(master: MasterProcess) -> None:
    """A stopped master stops reading: the kernel buffers fill, sends queue up in the client, and every
    call still ends at its deadline (TransportTimeoutError), never later."""

    async def run() -> None:
        async with MasterLink(master.address) as link:
            wire_port = (await link.describe()).wire_port
        client = MasterWireClient("127.0.0.1", wire_port)
        big = master_pb2.MatchPrefixRequest(block_hashes=[bytes([i % 251]) * 32 for i in range(65_536)])
        try:
            await client.call("Stats", master_pb2.StatsRequest(), T)
            os.kill(master.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                results = await asyncio.gather(
                    *(client.call("MatchPrefix", big, 0.5) for _ in range(20)), return_exceptions=True
                )
                elapsed = time.monotonic() - t0
            finally:
                os.kill(master.proc.pid, signal.SIGCONT)
            assert all(isinstance(r, TransportTimeoutError) for r in results), results[:3]
            assert elapsed < 1.5
            assert (await client.call("Stats", master_pb2.StatsRequest(), T)).policy == "hybrid"
        finally:
            await client.close()

    asyncio.run(run())
