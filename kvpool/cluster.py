"""`LocalCluster`: master + storage node + prefill + decode workers as child processes on 127.0.0.1.

Used by ``kvpool verify`` (when no addresses are given), the serving integration tests and the TTFT bench,
so all three exercise the very processes a deployment runs. Every child binds port 0 and announces itself
with one JSON readiness line; waiting for it has a deadline, and stdout is drained in a thread afterwards so
a chatty child never blocks on a full pipe. Children die with the cluster (``stop``), SIGTERM first.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

READY_TIMEOUT_S = 60.0


class LaunchError(RuntimeError):
    """A child exited or stayed silent past its readiness deadline (its stderr tail is in the message)."""


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    ready: dict
    stderr_path: Path

    @property
    def address(self) -> str:
        return f"{self.ready.get('host', '127.0.0.1')}:{self.ready['port']}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL now (fault injection: a node dying mid-request)."""
        if self.alive():
            self.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""


def spawn(name: str, argv: list[str], log_dir: Path, timeout_s: float = READY_TIMEOUT_S) -> Child:
    """Start ``python -m <argv>`` and wait for its ``{"ready": true, ...}`` line."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stderr_path = log_dir / f"{name}-{time.monotonic_ns()}.stderr"
    env = dict(os.environ, PYTHONUNBUFFERED="1", UCX_WARN_UNUSED_ENV_VARS="n")
    with stderr_path.open("wb") as err:
        popen = subprocess.Popen(
            [sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=err, env=env, text=True, bufsize=1
        )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True, name=f"pump-{name}").start()
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            break
        if line is None:
            break
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("ready"):
                return Child(name, popen, record, stderr_path)
    with contextlib.suppress(Exception):
        popen.kill()
    raise LaunchError(f"{name} not ready (rc={popen.poll()}): {stderr_path.read_text()[-3000:]}")


@dataclass
class LocalCluster:
    """``start()`` brings up master, node, prefill and decode; addresses in ``master``/``prefill``/..."""

    model: str = "tiny"
    block_size: int = 64
    node_capacity: str = "256MiB"
    transport: str = "tcp"
    threads: int = 1  # torch threads of both workers (the reference must use the same)
    worker_args: tuple[str, ...] = ()
    node_args: tuple[str, ...] = ()  # extra ``kvpool store node`` flags (``--metrics-port 0``...)
    log_dir: Path | None = None
    children: dict[str, Child] = field(default_factory=dict)

    def start(self) -> LocalCluster:
        logs = self.log_dir or Path(tempfile.mkdtemp(prefix="kvpool-cluster-"))
        try:
            master = spawn(
                "master",
                [
                    "kvpool.kvstore.master.cli",
                    "--port",
                    "0",
                    "--log-level",
                    "WARNING",
                    "--heartbeat-ms",
                    "200",
                    "--node-timeout-ms",
                    "1500",
                ],
                logs,
            )
            self.children["master"] = master
            self.log_dir = logs
            common = [
                "--master",
                master.address,
                "--model",
                self.model,
                "--block-size",
                str(self.block_size),
                "--transport",
                self.transport,
                "--store-timeout",
                "3",
                "--threads",
                str(self.threads),
                *self.worker_args,
            ]
            # node and workers only need the master: start them together (each import costs seconds)
            with ThreadPoolExecutor(3) as pool:
                node = pool.submit(self.start_node, logs)
                workers = {
                    role: pool.submit(spawn, role, ["kvpool.cli", role, *common], logs)
                    for role in ("prefill", "decode")
                }
                failures = []
                for name, fut in (("node", node), *workers.items()):
                    try:
                        child = fut.result()
                    except LaunchError as exc:
                        failures.append(exc)
                    else:
                        self.children[name] = child
                if failures:
                    raise failures[0]
        except BaseException:
            self.stop()
            raise
        self.log_dir = logs
        return self

    def start_node(self, logs: Path | None = None) -> Child:
        """(Re)start the storage node (after a test killed it)."""
        node = spawn(
            "node",
            [
                "kvpool.kvstore.cli",  # store-only entry: no torch import, starts in a fraction of the time
                "node",
                "--master",
                self.master,
                "--capacity",
                self.node_capacity,
                "--transport",
                "tcp,shm",
                *self.node_args,
            ],
            logs or self.log_dir or Path(tempfile.mkdtemp(prefix="kvpool-cluster-")),
        )
        self.children["node"] = node
        return node

    @property
    def master(self) -> str:
        return self.children["master"].address

    @property
    def prefill(self) -> str:
        return self.children["prefill"].address

    @property
    def decode(self) -> str:
        return self.children["decode"].address

    def stop(self) -> None:
        """Workers first (they may still be pushing), then the store; each group stopped concurrently."""
        for group in (("prefill", "decode"), ("node", "master")):
            children = [self.children[n] for n in group if n in self.children]
            for child in children:
                if child.alive():
                    child.popen.terminate()
            for child in children:
                child.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
