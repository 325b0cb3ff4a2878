"""The master wire (kvstore/protocol/master_wire.py, kvstore/master/wire_server.py) and MasterLink
(kvstore/protocol/master_link.py) against real masters: framing errors close the connection, bodies are
capped, errors arrive as their typed class, many calls are in flight at once, every wait has a deadline.

A master child process (``kvpool store master``, readiness line) for the protocol and failure cases; an
in-process ``MasterWireServer`` on the test's loop where the test must control the listener itself (a frame
deadline short enough to test, a small body cap, a restart on one port).
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
from kvpool.kvstore.errors import (
    BadRequestError,
    CapacityExceededError,
    MasterSilentError,
    ObjectNotFoundError,
    StoreError,
    StoreUnavailableError,
    TransportTimeoutError,
)
from kvpool.kvstore.master.core import MasterConfig, MasterCore
from kvpool.kvstore.master.node_notifier import NodeNotifier
from kvpool.kvstore.master.server import MasterServer
from kvpool.kvstore.master.wire_server import MasterWireServer
from kvpool.kvstore.protocol.master_link import SILENT_BACKOFF_S, MasterLink
from kvpool.kvstore.protocol.master_wire import HEADER, MAGIC, MAX_BODY, METHODS, MasterWireClient
from kvpool.proto import common_pb2, master_pb2

from tests.harness.master_proc import MasterProcess, ProbeNode

T = 5.0
Cluster = tuple[MasterProcess, ProbeNode]


def key(i: int, tag: bytes = b"w") -> bytes:
    return b"M" + tag * 8 + i.to_bytes(24, "little")


def meta(k: bytes, parent: bytes = b"", kind: int = common_pb2.MLA_BLOCK) -> common_pb2.ObjectMeta:
    return common_pb2.ObjectMeta(key=k, kind=kind, size=4096, checksum=7, parent=parent)


def in_flight(client: MasterWireClient) -> int:
    """Calls the client sent that are not answered yet (its connection's table of pending request ids)."""
    return len(client._conn.pending) if client._conn is not None else 0


async def stats_once_the_breaker_closes(link: MasterLink, within_s: float) -> master_pb2.StatsReply:
    """Stats, asked until the link stops failing fast: ``MasterSilentError`` while the breaker is open,
    until its background probe gets an answer."""
    t0 = time.monotonic()
    while True:
        try:
            return await link.call("Stats", master_pb2.StatsRequest())
        except MasterSilentError:
            assert time.monotonic() - t0 < within_s, "the probe never closed the breaker"
            await asyncio.sleep(0.02)


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


def test_method_table_covers_every_master_message_pair() -> None:
    names = {d.name.removesuffix("Request") for d in master_pb2.DESCRIPTOR.message_types_by_name.values()}
    assert set(METHODS) == {n for n in names if f"{n}Reply" in master_pb2.DESCRIPTOR.message_types_by_name}
    assert len({m.method_id for m in METHODS.values()}) == len(METHODS)
    for m in METHODS.values():
        assert m.core_method is None or callable(getattr(MasterCore, m.core_method)), m.name
        assert m.request.DESCRIPTOR.full_name == f"kvpool.v1.{m.name}Request"
        assert m.reply.DESCRIPTOR.full_name == f"kvpool.v1.{m.name}Reply"


def test_errors_arrive_as_the_class_the_master_raised(master: MasterProcess) -> None:
    async def run() -> None:
        async with MasterLink(master.address) as link:
            cases = [
                ("Lookup", master_pb2.LookupRequest(keys=[b""]), BadRequestError),
                ("PutCommit", master_pb2.PutCommitRequest(put_id="nope:1"), ObjectNotFoundError),
                ("Release", master_pb2.ReleaseRequest(lease_id="garbage"), BadRequestError),
                ("Pin", master_pb2.PinRequest(keys=[key(1)], ttl_ms=1 << 31), BadRequestError),
                ("MatchPrefix", master_pb2.MatchPrefixRequest(block_hashes=[b"short"]), BadRequestError),
            ]
            for name, request, expected in cases:
                with pytest.raises(StoreError) as err:
                    await link.call(name, request)
                assert type(err.value) is expected, name
                assert str(err.value).startswith(f"master {name}: "), err.value
            assert link.counters == {"calls": len(cases)}  # one connection, nothing retried
            assert await link.call("Stats", master_pb2.StatsRequest())  # the connection survived them

    asyncio.run(run())


def test_pipelined_concurrent_calls_are_answered_by_request_id(master: MasterProcess) -> None:
    async def run() -> None:
        async with MasterLink(master.address) as link:
            keys = [key(i, b"p") for i in range(20)]
            for k in keys:
                await _put(link, meta(k))
        client = MasterWireClient(master.address)
        try:
            await client.call("Stats", master_pb2.StatsRequest(), T)  # connected
            requests = [
                master_pb2.LookupRequest(keys=[keys[i % 20], key(1000 + i, b"p")]) for i in range(200)
            ]
            calls = [asyncio.ensure_future(client.call("Lookup", r, T)) for r in requests]
            await asyncio.sleep(0)  # every call has been written before any reply could be read
            assert in_flight(client) == 200
            replies = await asyncio.gather(*calls)
            for i, reply in enumerate(replies):
                assert [f.meta.key for f in reply.found] == [keys[i % 20]]
                assert list(reply.missing) == [key(1000 + i, b"p")]
            assert in_flight(client) == 0
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
    with socket.create_connection(("127.0.0.1", master.port), timeout=T) as sock:
        sock.sendall(junk)
        assert _closed_by_peer(sock, T)

    async def fresh_client_works() -> None:
        client = MasterWireClient(master.address)
        try:
            assert (await client.call("Stats", master_pb2.StatsRequest(), T)).policy == "hybrid"
        finally:
            await client.close()

    asyncio.run(fresh_client_works())


def test_undecodable_body_is_a_bad_request_on_a_connection_that_keeps_working(master: MasterProcess) -> None:
    async def run() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", master.port)
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
            assert got[41][0] == BadRequestError.code and b"undecodable" in got[41][1]
            assert got[42][0] == 0 and master_pb2.StatsReply.FromString(got[42][1]).policy == "hybrid"
        finally:
            writer.close()

    asyncio.run(run())


def test_a_bug_costs_one_call_answered_as_an_internal_store_error_and_counted() -> None:
    core = MasterCore(MasterConfig())
    wire = MasterWireServer(core, NodeNotifier(1.0, core.count))

    def broken(_request: object) -> None:
        raise ZeroDivisionError("boom")

    core.stats = broken  # type: ignore[method-assign]
    with pytest.raises(StoreError) as err:
        wire.run(METHODS["Stats"], b"")
    assert type(err.value) is StoreError and str(err.value) == "internal error: ZeroDivisionError: boom"
    with pytest.raises(BadRequestError):
        wire.run(METHODS["Lookup"], master_pb2.LookupRequest(keys=[b""]).SerializeToString())
    assert core.counters["rpc_internal"] == 1 and core.counters["rpc_bad_request"] == 1
    reply = master_pb2.LookupReply.FromString(wire.run(METHODS["Lookup"], b"")[0])
    assert not reply.found


def test_truncated_frame_is_closed_at_the_frame_deadline() -> None:
    async def run() -> None:
        core = MasterCore(MasterConfig())
        wire = MasterWireServer(core, NodeNotifier(1.0, core.count), frame_timeout_s=0.3)
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
            client = MasterWireClient(f"127.0.0.1:{port}")
            assert (await client.call("Stats", master_pb2.StatsRequest(), T)).counters[
                "wire_frame_timeouts"
            ] == 3
            await client.close()
        finally:
            await wire.close()

    asyncio.run(run())


def test_a_reply_over_the_size_limit_is_refused_not_a_dropped_connection() -> None:
    async def run() -> None:
        core = MasterCore(MasterConfig())
        wire = MasterWireServer(core, NodeNotifier(1.0, core.count), max_body=4096)
        client = MasterWireClient(f"127.0.0.1:{await wire.start('127.0.0.1', 0)}")
        try:
            node = common_pb2.NodeEndpoint(node_id="n1", host="127.0.0.1", grpc_port=9, tcp_port=9)
            core.register_node(master_pb2.RegisterNodeRequest(node=node, dram_capacity_bytes=1 << 30))
            keys = [key(i, b"z") for i in range(80)]
            for k in keys:
                put = core.put_start(master_pb2.PutStartRequest(meta=meta(k)))
                core.put_commit(master_pb2.PutCommitRequest(put_id=put.put_id))
            lookup = master_pb2.LookupRequest(keys=keys)
            assert lookup.ByteSize() < 4096 < core.lookup(lookup).ByteSize()
            with pytest.raises(CapacityExceededError, match="frame cap"):
                await client.call("Lookup", lookup, T)
            assert (await client.call("Stats", master_pb2.StatsRequest(), T)).policy == "hybrid"
            with socket.create_connection(
                ("127.0.0.1", wire.port), timeout=T
            ) as sock:  # a request over the cap
                sock.sendall(HEADER.pack(MAGIC, METHODS["Lookup"].method_id, 0, 0, 1, 4097) + b"\0" * 4097)
                assert await asyncio.to_thread(_closed_by_peer, sock, T)
        finally:
            await client.close()
            await wire.close()

    asyncio.run(run())


def test_killed_master_fails_in_flight_and_new_calls_fast(tmp_path: Path) -> None:
    m = MasterProcess(tmp_path)

    async def run() -> None:
        client = MasterWireClient(m.address, connect_timeout_s=1.0)
        try:
            await client.call("Stats", master_pb2.StatsRequest(), T)
            os.kill(m.proc.pid, signal.SIGSTOP)  # the next call is sent and never answered...
            call = asyncio.ensure_future(client.call("Stats", master_pb2.StatsRequest(), 30.0))
            await asyncio.sleep(0.2)
            assert in_flight(client) == 1 and not call.done()
            t0 = time.monotonic()
            os.kill(m.proc.pid, signal.SIGKILL)  # ...until the master dies
            with pytest.raises(StoreUnavailableError) as err:
                await call
            assert not isinstance(err.value, TransportTimeoutError)
            assert time.monotonic() - t0 < 2.0
            m.proc.wait(timeout=T)  # (while the kernel tears the process down a connect may still succeed)
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailableError):  # the next call reconnects and finds nobody
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
        port = await server.start()
        client = MasterWireClient(f"127.0.0.1:{port}")
        try:
            await client.call("Stats", master_pb2.StatsRequest(), T)
            await server.wire.close()
            with pytest.raises(StoreUnavailableError):
                await client.call("Stats", master_pb2.StatsRequest(), T)
            await server.wire.start("127.0.0.1", port)
            assert (await client.call("Stats", master_pb2.StatsRequest(), T)).policy == "hybrid"
        finally:
            await client.close()
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
                t0 = time.monotonic()
                for _ in range(20):
                    with pytest.raises(MasterSilentError):
                        await link.call("Lookup", master_pb2.LookupRequest(keys=[key(1, b"x")]))
                assert time.monotonic() - t0 < 0.05
                await asyncio.sleep(3 * SILENT_BACKOFF_S[0] + 0.6)  # probes time out meanwhile
                assert link.counters["probes"] >= 1
                assert link.counters["failed_fast"] == 20 and link.counters["silent"] == 1
                with pytest.raises(MasterSilentError):  # the breaker is still open
                    await link.call("Stats", master_pb2.StatsRequest())
            finally:
                os.kill(master.proc.pid, signal.SIGCONT)
            reply = await stats_once_the_breaker_closes(link, SILENT_BACKOFF_S[1] + 1.5)
            assert isinstance(reply, master_pb2.StatsReply)

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
            # the breaker's probe gets an answer from the thawed master
            reply = await stats_once_the_breaker_closes(link, 30.0)
            assert isinstance(reply, master_pb2.StatsReply)

    asyncio.run(run())


def test_a_send_blocked_by_a_stalled_master_ends_at_the_deadline(master: MasterProcess) -> None:
    """A stopped master stops reading: the kernel buffers fill, sends queue up in the client, and every
    call still ends at its deadline (TransportTimeoutError), never later."""

    async def run() -> None:
        client = MasterWireClient(master.address)
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
