"""`LocalCluster`: master + storage node + prefill + decode workers as child processes on 127.0.0.1.

Used by ``kvpool verify`` (when no addresses are given), the serving integration tests and the TTFT bench,
so all three exercise the very processes a deployment runs. Every child binds port 0 and announces itself
with one JSON readiness line; waiting for it has a deadline, and stdout is drained in a thread afterwards so
a chatty child never blocks on a full pipe. Children die with the cluster (``stop``), SIGTERM first.
"""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.launch.service_argv import master_argv, node_argv, worker_argv
from kvpool.runtime.spawn import Child, LaunchError, spawn


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
            master = spawn("master", master_argv(heartbeat_ms=200, node_timeout_ms=1500), logs)
            self.children["master"] = master
            self.log_dir = logs
            flags = dict(
                model=self.model, block_size=self.block_size, threads=self.threads, transport=self.transport
            )
            extra = ["--store-timeout", "3", *self.worker_args]
            # node and workers only need the master: start them together (each import costs seconds)
            with ThreadPoolExecutor(3) as pool:
                node = pool.submit(self.start_node, logs)
                workers = {
                    role: pool.submit(
                        spawn, role, worker_argv(role, master.address, **flags, extra=extra), logs
                    )
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
            node_argv(self.master, self.node_capacity, "tcp,shm", self.node_args),
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
