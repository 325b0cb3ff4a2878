"""Baselines for the store bench: memcpy, a plain-socket ceiling, Redis and Mooncake Store over TCP.

Each ``section_*`` function measures one family and returns ``{"rows": [...], "skipped": {...}}``; the parent
(``store_bench.py``) runs each in its own child process with a deadline, so a stuck baseline is killed and
reported as skipped instead of hanging the run. Servers run as separate processes (server + client), the
same shape as the store's own paths, and the bench process is always the client (Mooncake excepted: its
client must live in the Mooncake venv, see ``store_mooncake.py``).

Run standalone, this module is the plain-socket server: ``python bench/store_baselines.py socket-server``.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import math
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from store_common import (
    HOST,
    MB,
    Plan,
    Row,
    VerifyError,
    check_equal,
    children,
    free_port,
    gbps,
    make_payload,
    read_json_line,
    stamp,
    time_reps,
    wait_port,
)

BENCH_DIR = Path(__file__).resolve().parent
MOONCAKE_VENV = BENCH_DIR / ".venv-mooncake"
MOONCAKE_PKG = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
COLD_RING_BYTES = 128 * MB  # 4x the 32 MiB L3 here: a rotating ring of buffers this big keeps memcpy honest


# --------------------------------------------------------------------------------------------- memcpy


def _ring(nbytes: int, count: int) -> list[np.ndarray]:
    """``count`` distinct buffers, pre-faulted so the timed copy never pays for page faults."""
    return [np.ones(nbytes, dtype=np.uint8) for _ in range(count)]


def section_memcpy(plan: Plan) -> dict[str, Any]:
    """``np.copyto`` in one process: the physical limit for moving an object's bytes.

    The main row copies between a hot buffer and a ring of distinct buffers larger than the L3 cache
    (``COLD_RING_BYTES``), which is what a store get does: the object is not in cache, the caller's
    buffer is. The ``cache-hot`` row copies one pair of buffers over and over (the figure in
    overview §5) and is shown for context only; ratios use the cold row.
    """
    cold = Row("memcpy", "memcpy np.copyto (cold src)")
    hot = Row("memcpy_hot", "memcpy (cache-hot)", note="same src/dst each rep; context only")
    for size in plan.sizes_mb:
        n = size * MB
        src = make_payload(n)
        reps = plan.reps_for(size)
        ring = _ring(n, max(2, math.ceil(COLD_RING_BYTES / n)))

        def put_prep(i: int, src: np.ndarray = src) -> None:
            stamp(src, i)

        def put_op(i: int, src: np.ndarray = src, ring: list[np.ndarray] = ring) -> None:
            np.copyto(ring[i % len(ring)], src)

        def put_verify(i: int, src: np.ndarray = src, ring: list[np.ndarray] = ring) -> None:
            check_equal(ring[i % len(ring)], src, "memcpy put")

        cold.put[size] = gbps(n, time_reps(put_op, put_verify, plan.warmup, reps, put_prep))
        for buf in ring:  # every ring slot now holds a distinct object to read back
            np.copyto(buf, src)
        dst = np.zeros(n, dtype=np.uint8)

        def get_prep(i: int, ring: list[np.ndarray] = ring, dst: np.ndarray = dst) -> None:
            stamp(ring[i % len(ring)], i)
            dst[:8] = 0

        def get_op(i: int, ring: list[np.ndarray] = ring, dst: np.ndarray = dst) -> None:
            np.copyto(dst, ring[i % len(ring)])

        def get_verify(i: int, ring: list[np.ndarray] = ring, dst: np.ndarray = dst) -> None:
            check_equal(dst, ring[i % len(ring)], "memcpy get")

        cold.get[size] = gbps(n, time_reps(get_op, get_verify, plan.warmup, reps, get_prep))

        hot_dst = np.zeros(n, dtype=np.uint8)

        def hot_op(i: int, src: np.ndarray = src, hot_dst: np.ndarray = hot_dst) -> None:
            np.copyto(hot_dst, src)

        def hot_verify(i: int, src: np.ndarray = src, hot_dst: np.ndarray = hot_dst) -> None:
            check_equal(hot_dst, src, "memcpy hot")

        hot.put[size] = hot.get[size] = gbps(n, time_reps(hot_op, hot_verify, plan.warmup, reps, put_prep))
        del ring
    return {"rows": [cold.to_json(), hot.to_json()]}


# --------------------------------------------------------------------------------------- plain socket

_HDR = struct.Struct("<cQQ")  # op, nbytes, rep index
_OP_PUT, _OP_GET, _OP_HASH, _OP_QUIT = b"P", b"G", b"H", b"Q"
PAYLOAD_SEED = 11  # client and server derive the same get payload from it, so the client can check equality


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got)
        if n == 0:
            raise ConnectionError("peer closed mid-message")
        got += n


def socket_server(max_bytes: int, host: str = HOST) -> None:
    """Plain blocking-socket server: receive puts into a preallocated buffer, serve gets from another.

    Nothing but ``recv_into``/``sendall`` on a TCP_NODELAY socket: the ceiling any TCP data plane in Python
    can reach on this host. Verification is a separate, untimed op (``H``) that returns the received
    bytes to the client and then clears the buffer, so the next rep cannot pass on stale data.
    """
    put_buf = np.zeros(max_bytes, dtype=np.uint8)
    get_buf = make_payload(max_bytes, PAYLOAD_SEED)
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((host, 0))
    lsock.listen(1)
    lsock.settimeout(60)
    print(json_line({"ready": True, "port": lsock.getsockname()[1]}), flush=True)
    conn, _ = lsock.accept()
    conn.settimeout(120)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hdr = bytearray(_HDR.size)
    put_view = memoryview(put_buf)
    with conn:
        while True:
            _recv_exact(conn, memoryview(hdr))
            op, n, i = _HDR.unpack(hdr)
            if op == _OP_PUT:
                _recv_exact(conn, put_view[:n])
                conn.sendall(b"k")
            elif op == _OP_GET:
                view = get_buf[:n]
                head, tail = view[:8].copy(), view[-8:].copy()
                stamp(view, i)
                conn.sendall(memoryview(view))
                view[:8], view[-8:] = head, tail  # pristine again: other sizes share this buffer
            elif op == _OP_HASH:
                conn.sendall(put_view[:n])
                put_buf[:n] = 0
            else:
                return


def json_line(obj: dict[str, Any]) -> str:
    import json

    return json.dumps(obj)


def section_socket(plan: Plan) -> dict[str, Any]:
    """Plain-socket ceiling: one round trip per object through a blocking TCP socket on loopback."""
    max_bytes = max(plan.sizes_mb) * MB
    with children() as procs:
        proc = subprocess.Popen(
            [sys.executable, __file__, "socket-server", str(max_bytes)], stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        port = int(read_json_line(proc, 60, "port")["port"])
        row = measure_socket(plan, HOST, port)
    return {"rows": [row.to_json()]}


def measure_socket(plan: Plan, host: str, port: int) -> Row:
    """Put/get rows of a running ``socket_server`` at ``host:port`` (loopback here; a veth in the
    multi-host bench), ended with a quit op."""
    row = Row(
        "socket", "plain socket (recv_into)", note="blocking sockets, preallocated buffers, TCP_NODELAY"
    )
    max_bytes = max(plan.sizes_mb) * MB
    sock = socket.create_connection((host, port), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = bytearray(1)
    try:
        for size in plan.sizes_mb:
            n = size * MB
            reps = plan.reps_for(size)
            src = make_payload(n)
            back = np.zeros(n, dtype=np.uint8)

            def put_prep(i: int, src: np.ndarray = src) -> None:
                stamp(src, i)

            def put_op(i: int, n: int = n, src: np.ndarray = src) -> None:
                sock.sendall(_HDR.pack(_OP_PUT, n, i))
                sock.sendall(memoryview(src))
                _recv_exact(sock, memoryview(ack))

            def put_verify(i: int, n: int = n, src: np.ndarray = src, back: np.ndarray = back) -> None:
                sock.sendall(_HDR.pack(_OP_HASH, n, i))
                _recv_exact(sock, memoryview(back))
                check_equal(back, src, "socket put")

            row.put[size] = gbps(n, time_reps(put_op, put_verify, plan.warmup, reps, put_prep))

            want = make_payload(max_bytes, PAYLOAD_SEED)[:n].copy()  # the server's slice of its buffer
            dst = np.zeros(n, dtype=np.uint8)
            dview = memoryview(dst)

            def get_prep(i: int, dst: np.ndarray = dst) -> None:
                dst[:8] = 0
                dst[-8:] = 0

            def get_op(i: int, n: int = n, dview: memoryview = dview) -> None:
                sock.sendall(_HDR.pack(_OP_GET, n, i))
                _recv_exact(sock, dview)

            def get_verify(i: int, dst: np.ndarray = dst, want: np.ndarray = want) -> None:
                stamp(want, i)
                check_equal(dst, want, "socket get")

            row.get[size] = gbps(n, time_reps(get_op, get_verify, plan.warmup, reps, get_prep))
        sock.sendall(_HDR.pack(_OP_QUIT, 0, 0))
    finally:
        sock.close()
    return row


# ---------------------------------------------------------------------------------------------- Redis


def _start_redis(procs: list[subprocess.Popen[Any]]) -> int:
    """Start a throwaway ``redis-server`` on a free loopback port with persistence off; return the port."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server not on PATH (apt-get install redis-server)")
    last: Exception | None = None
    for _ in range(3):  # a free port can be taken between probe and bind; try a fresh one
        port = free_port()
        proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(port),
                "--bind",
                HOST,
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(proc)
        try:
            wait_port(port, 20, proc)
            return port
        except (RuntimeError, TimeoutError) as exc:
            last = exc
    raise RuntimeError(f"redis-server did not start: {last}")


def section_redis(plan: Plan) -> dict[str, Any]:
    """Redis SET/GET through redis-py: the familiar key-value store a KV cache is often first put on."""
    try:
        import redis
    except ImportError:
        return {"rows": [], "skipped": {"redis": "redis-py not installed (pip install -e '.[test]')"}}
    try:
        import hiredis  # noqa: F401  (redis-py parses replies in C when it is installed)

        parser = "hiredis parser"
    except ImportError:
        parser = "pure-Python reply parser (no hiredis)"
    row = Row("redis", "Redis SET/GET (redis-py)", note=f"redis-py {redis.__version__}, {parser}")
    with children() as procs:
        port = _start_redis(procs)
        r = redis.Redis(host=HOST, port=port, socket_timeout=60, socket_connect_timeout=10)
        r.ping()
        for size in plan.sizes_mb:
            n = size * MB
            reps = plan.reps_for(size)
            src = make_payload(n)
            blobs: dict[int, bytes] = {}

            def key(i: int, size: int = size) -> str:
                return f"bench:{size}:{i}"

            def put_prep(i: int, src: np.ndarray = src, blobs: dict[int, bytes] = blobs) -> None:
                stamp(src, i)
                blobs.clear()
                blobs[i] = src.tobytes()

            def put_op(i: int, blobs: dict[int, bytes] = blobs, key: Any = key) -> None:
                r.set(key(i), blobs[i])

            def put_verify(i: int, src: np.ndarray = src, key: Any = key) -> None:
                check_equal(r.get(key(i)), src, "redis put")

            row.put[size] = gbps(n, time_reps(put_op, put_verify, plan.warmup, reps, put_prep))
            blobs.clear()
            got: dict[int, bytes] = {}

            def get_op(i: int, got: dict[int, bytes] = got, key: Any = key) -> None:
                got[i] = r.get(key(i))

            def get_verify(i: int, src: np.ndarray = src, got: dict[int, bytes] = got) -> None:
                stamp(src, i)
                check_equal(got.pop(i), src, "redis get")

            row.get[size] = gbps(n, time_reps(get_op, get_verify, plan.warmup, reps))
            r.flushall()
        r.close()
    return {"rows": [row.to_json()]}


# ------------------------------------------------------------------------------------ Mooncake Store


def _venv_python() -> Path:
    return MOONCAKE_VENV / "bin" / "python"


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def ensure_mooncake(install_timeout_s: float = 420) -> tuple[Path | None, str]:
    """Make ``bench/.venv-mooncake`` hold an importable Mooncake Store; return (python, "") or (None, why).

    Mooncake goes into its own venv, never the project's: its wheel pins its own native stack, and the
    project venv must not depend on it. The non-CUDA wheel needs Debian's ``libibverbs1`` even for TCP.
    """
    if ctypes.util.find_library("ibverbs") is None:
        if os.geteuid() == 0 and shutil.which("apt-get"):
            res = _run(["apt-get", "install", "-y", "-q", "libibverbs1"], timeout=300)
            if ctypes.util.find_library("ibverbs") is None:
                why = _tail(res.stderr or res.stdout)
                return None, f"libibverbs1 missing and apt-get install failed: {why}"
        else:
            return None, "libibverbs1 missing; the non-CUDA Mooncake wheel needs it (apt install)"
    py = _venv_python()
    check = [str(py), "-c", "import mooncake.store, numpy"]
    if py.exists() and _run(check, 120).returncode == 0:
        return py, ""
    end = time.monotonic() + install_timeout_s
    if not py.exists():
        res = _run([sys.executable, "-m", "venv", str(MOONCAKE_VENV)], timeout=120)
        if res.returncode != 0:
            return None, f"could not create {MOONCAKE_VENV.name}: {_tail(res.stderr)}"
    try:
        pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", MOONCAKE_PKG, "numpy"]
        res = _run(pip, timeout=max(30.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None, f"pip install {MOONCAKE_PKG} ran past {install_timeout_s:.0f}s (no network?)"
    if res.returncode != 0:
        return None, f"pip install {MOONCAKE_PKG} failed (no network?): {_tail(res.stderr or res.stdout, 1)}"
    res = _run(check, 120)
    if res.returncode != 0:
        return None, f"mooncake.store does not import: {_tail(res.stderr)}"
    return py, ""


def section_mooncake(plan: Plan) -> dict[str, Any]:
    """Mooncake Store over TCP: local master, an owner process holding the segment, a 0-byte client.

    The client mounts no memory, so every object crosses TCP to the owner, exactly as in
    overview §5. The client runs in the Mooncake venv and does its own timing with the same
    rules (``store_mooncake.py``); this side only starts the processes and collects the rows.
    """
    py, why = ensure_mooncake()
    if py is None:
        return {"rows": [], "skipped": {"mooncake": why}}
    master_exe = py.parent / "mooncake_master"
    if not master_exe.exists():
        return {"rows": [], "skipped": {"mooncake": f"{master_exe} missing from the wheel"}}
    worker = str(BENCH_DIR / "store_mooncake.py")
    with children() as procs:
        rpc_port, metrics_port = free_port(), free_port()
        # a 1 s read lease (default 10 s) lets each size's objects be removed quickly; reads take far less
        master_cmd = [
            str(master_exe),
            f"--rpc_port={rpc_port}",
            f"--metrics_port={metrics_port}",
            "--enable_metric_reporting=false",
            "--default_kv_lease_ttl=1000",
        ]
        master = subprocess.Popen(master_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(master)
        wait_port(rpc_port, 30, master)  # setup() against a dead master blocks ~90 s: probe first
        addr = f"{HOST}:{rpc_port}"
        seg = _segment_bytes(plan)
        owner = subprocess.Popen(
            [str(py), worker, "owner", addr, str(seg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        procs.append(owner)
        read_json_line(owner, 120, "ready")
        import json

        client = subprocess.Popen(
            [str(py), worker, "client", addr, json.dumps(plan.to_json())],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        procs.append(client)
        res = read_json_line(client, 560, "rows")
        with contextlib.suppress(Exception):
            assert owner.stdin is not None
            owner.stdin.close()
    if res.get("error"):
        raise VerifyError(res["error"])
    res["skipped"] = {
        f"{k} (partial)" if any(r["id"] == k for r in res["rows"]) else k: v
        for k, v in (res.get("skipped") or {}).items()
    }
    return res


def _segment_bytes(plan: Plan) -> int:
    """Owner segment that holds every object the client writes, even if no removal succeeds (a key read
    a moment ago stays leased), plus headroom: a full segment fails puts with -200 (no space)."""
    total = sum(s * MB * (plan.reps_for(s) + plan.warmup) for s in plan.sizes_mb)
    return max(1 << 30, int(2 * total * 1.25) + 256 * MB)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "socket-server":
        socket_server(int(sys.argv[2]), *sys.argv[3:4])
    else:
        sys.exit("usage: store_baselines.py socket-server MAX_BYTES [HOST]")
