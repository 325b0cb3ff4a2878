"""A process without the cluster secret (or with another one) is told so, by every listener it knocks on.

Before: the master wire and the node's data plane closed such a connection without a word, and the client
raised ``StoreUnavailableError: master wire: connection lost`` from a master that was up and well, so an
operator went looking for a crash. Now each refusal is an ``UnauthenticatedError`` whose message says what
was wrong (no secret, another secret) and where this process reads its secret from; a storage node and a
worker started that way stop at once with that message instead of retrying or missing on every request.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from kvpool.kvstore.errors import StoreError, UnauthenticatedError
from kvpool.kvstore.protocol import master_wire
from kvpool.kvstore.protocol.master_wire import MasterWireClient, call_blocking
from kvpool.proto import master_pb2
from kvpool.runtime import cluster_auth

from tests.harness.master_proc import MasterProcess

SECRET = "s" * 48
STATS = master_pb2.StatsRequest()


def _env_without_secret(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_CLUSTER_SECRET")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory):
    m = MasterProcess(tmp_path_factory.mktemp("auth"), env={cluster_auth.ENV_VALUE: SECRET})
    yield m
    m.kill()


@pytest.fixture
def own_secret():
    """Set this test process's secret (``None``: none) for one case; what it was is restored after."""
    saved = (list(cluster_auth._SECRET), list(cluster_auth._SOURCE))
    yield cluster_auth.configure
    cluster_auth._SECRET[:], cluster_auth._SOURCE[:] = saved


def test_a_client_without_the_secret_is_told_so_not_connection_lost(master, own_secret) -> None:
    own_secret(None)
    with pytest.raises(UnauthenticatedError) as blocking:
        call_blocking(master.address, "Stats", STATS)

    async def multiplexed() -> list[BaseException]:
        client = MasterWireClient(master.address)
        try:  # a gathered batch: every call gets the refusal, none is left waiting
            calls = [client.call("Stats", STATS, 5.0) for _ in range(3)]
            return list(await asyncio.gather(*calls, return_exceptions=True))
        finally:
            await client.close()

    errors = asyncio.run(multiplexed())
    for err in (blocking.value, *errors):
        assert isinstance(err, UnauthenticatedError), repr(err)
        message = str(err)
        assert "no cluster secret" in message and "connection lost" not in message
        assert cluster_auth.ENV_FILE in message and cluster_auth.ENV_VALUE in message
        assert master.address in message
    own_secret(SECRET.encode())  # the master itself is up and well
    assert call_blocking(master.address, "Stats", STATS).nodes == 0


def test_a_client_with_another_secret_is_told_where_its_secret_came_from(
    master, own_secret, tmp_path: Path
) -> None:
    wrong = tmp_path / "secret"
    wrong.write_text("w" * 48)
    own_secret(cluster_auth.read_secret_file(str(wrong)), f"{cluster_auth.ENV_FILE}={wrong}")
    with pytest.raises(UnauthenticatedError) as err:
        call_blocking(master.address, "Stats", STATS)
    assert "wrong cluster secret" in str(err.value) and str(wrong) in str(err.value)


def _first_answer(address: str, payload: bytes) -> tuple[int, int, int, bytes]:
    """Send ``payload`` on a fresh raw connection to the master wire; the first frame it answers."""
    with socket.create_connection(master_wire.split_address(address), timeout=5.0) as sock:
        sock.sendall(payload)
        frames = master_wire.FrameBuffer()
        got: list = []
        while not got:
            data = sock.recv(1 << 16)
            assert data, "closed without the refusal frame"
            got = frames.feed(data)
    return got[0]


def test_a_stale_hello_is_told_to_check_the_clock_not_the_secret(master, own_secret) -> None:
    own_secret(SECRET.encode())
    stale = cluster_auth.hello(SECRET.encode(), now=lambda: 0.0)  # 1970: far outside the window
    _, status, _, body = _first_answer(master.address, stale + master_wire.encode(9, 0, 1, b""))
    err = master_wire.refusal_error(status, body, master.address)
    assert isinstance(err, UnauthenticatedError) and "stale hello" in str(err) and "clock" in str(err)
    assert "not the cluster's" not in str(err)


def test_a_refused_connection_runs_nothing_and_a_stalled_hello_is_cut_off(master) -> None:
    """The refusal comes before any frame is read (a pipelined PutStart does not run), and a peer that
    starts a hello and stalls is closed after the frame deadline, not held forever."""
    meta = master_pb2.PutStartRequest().meta
    meta.key, meta.size, meta.checksum = b"M" + os.urandom(32), 64, 1
    put = master_wire.encode(1, 0, 1, master_pb2.PutStartRequest(meta=meta).SerializeToString())
    method_id, status, request_id, _body = _first_answer(master.address, put * 3)
    assert (method_id, status, request_id) == (0, UnauthenticatedError.code, 0)
    with socket.create_connection(master_wire.split_address(master.address), timeout=15.0) as sock:
        sock.sendall(cluster_auth.HELLO_MAGIC)  # a hello that never completes
        assert sock.recv(1) == b""  # closed by the master (frame deadline), before this recv's 15 s
    # nothing the refused peers sent ran: the pipelined PutStarts placed nothing
    assert call_blocking(master.address, "Stats", STATS, key=SECRET.encode()).objects == 0


def test_a_storage_node_without_the_secret_stops_and_says_why(master, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "kvpool.kvstore.cli", "node", "--master", master.address,
            "--capacity", "16MiB", "--transport", "tcp", "--no-prefault"]  # fmt: skip
    done = subprocess.run(argv, env=_env_without_secret(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "UnauthenticatedError" in done.stderr and "no cluster secret" in done.stderr, done.stderr[-2000:]
    assert cluster_auth.ENV_VALUE in done.stderr


def test_a_worker_without_the_secret_stops_and_says_why(master) -> None:
    argv = [sys.executable, "-m", "kvpool", "prefill", "--master", master.address, "--model", "tiny",
            "--threads", "1", "--port", "0"]  # fmt: skip
    done = subprocess.run(argv, env=_env_without_secret(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "the store refused this worker" in done.stderr and "no cluster secret" in done.stderr
    assert cluster_auth.ENV_FILE in done.stderr


def test_a_store_error_from_a_refusal_is_still_a_store_problem() -> None:
    """Serving paths treat a store problem as a miss: the refusal is a StoreUnavailableError like any
    unreachable store, so nothing in them changes; only its message and type are precise."""
    assert issubclass(UnauthenticatedError, StoreError)
    from kvpool.kvstore.errors import StoreUnavailableError, error_for_code

    assert isinstance(error_for_code(UnauthenticatedError.code, "x"), UnauthenticatedError)
    assert issubclass(UnauthenticatedError, StoreUnavailableError)
