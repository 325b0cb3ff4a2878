"""Start store processes (a storage node, a master) as children and wait for their readiness lines.

For tests, benchmarks and local launchers: ``start_master(log_dir)`` then ``start_node(log_dir, m.address)``
give handles with the bound ports (dynamic by default), ``endpoint`` (a NodeEndpoint) and ``stop()``
(SIGTERM, exit code). Each launcher waits, with a deadline, for the one JSON readiness line on stdout,
skipping any other line (UCX may log there), then keeps draining stdout in a thread so the child never
blocks on a full pipe. Children run ``python -m kvpool.kvstore.cli`` (no torch import) via subprocess:
never fork a process that may have initialised UCX.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.proto import common_pb2

READY_TIMEOUT_S = 30.0


@dataclass
class Proc:
    """A started child process and its readiness record."""

    popen: subprocess.Popen
    ready: dict
    stderr_path: Path
    lines: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        if self.alive():
            self.popen.kill()
        return self.popen.wait(10)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""


@dataclass
class NodeProc(Proc):
    @property
    def endpoint(self) -> common_pb2.NodeEndpoint:
        r = self.ready
        return common_pb2.NodeEndpoint(
            node_id=r["node_id"],
            host=r["host"],
            grpc_port=r["grpc_port"],
            tcp_port=r["tcp_port"],
            ucx_port=r["ucx_port"],
            shm_name=r["shm_name"],
            host_id=r["host_id"],
        )

    @property
    def grpc_target(self) -> str:
        return f"{self.ready['host']}:{self.ready['grpc_port']}"


def _spawn(
    cls: type,
    args: list[str],
    log_dir: Path,
    name: str,
    ready_key: str = "ready",
    timeout: float = READY_TIMEOUT_S,
):  # type: ignore[no-untyped-def]
    log_dir.mkdir(parents=True, exist_ok=True)
    stderr_path = log_dir / f"{name}-{time.monotonic_ns()}.stderr"
    env = dict(os.environ, PYTHONUNBUFFERED="1", UCX_WARN_UNUSED_ENV_VARS="n")
    with stderr_path.open("wb") as err:
        popen = subprocess.Popen(
            [sys.executable, "-m", "kvpool.kvstore.cli", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            text=True,
            bufsize=1,
        )
    lines: queue.Queue[str | None] = queue.Queue()
    seen: list[str] = []

    def pump() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            seen.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            line = lines.get(timeout=max(remaining, 0.01))
        except queue.Empty:
            line = ""
            if remaining > 0:
                continue
        if line is None or remaining <= 0:
            with contextlib.suppress(Exception):
                popen.kill()
            raise RuntimeError(f"{name} not ready (rc={popen.poll()}): {stderr_path.read_text()[-3000:]}")
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get(ready_key):
                return cls(popen, record, stderr_path, seen)


def start_node(
    log_dir: Path,
    master: str | None = None,
    capacity: str = "64MiB",
    transports: str = "tcp,shm,ucx",
    *extra: str,
    prefault: bool = True,
) -> NodeProc:
    """``kvpool store node`` as a child; ``master=None`` starts it standalone (``--no-master``).

    ``extra``: more node flags (``--ssd-path``, ``--frame-timeout``...). ``prefault=False`` skips backing the
    pool at startup (faster start, slower first puts; tests use it).
    """
    where = ["--master", master] if master else ["--no-master"]
    args = ["node", *where, "--capacity", capacity, "--transport", transports, *extra]
    if not prefault:
        args.append("--no-prefault")
    return _spawn(NodeProc, args, log_dir, "node")


@dataclass
class MasterProc(Proc):
    @property
    def address(self) -> str:
        return f"{self.ready.get('host', '127.0.0.1')}:{self.ready['port']}"


def start_master(log_dir: Path, *extra: str, port: int = 0) -> MasterProc:
    """``kvpool store master`` as a child (``port`` fixed when a restarted master must keep its address)."""
    return _spawn(
        MasterProc,
        ["master", "--port", str(port), "--log-level", "WARNING", *extra],
        log_dir,
        "master",
    )
