"""Helpers to run a real master in a child process (tests, benchmarks, other teams' end-to-end tests).

``MasterProcess`` starts ``kvpool store master`` and reads its readiness line; ``call`` makes one master call
over the wire, blocking (typed errors). ``ProbeNode`` is a real gRPC StorageNode endpoint for master-only
tests.

A probe node is a real gRPC StorageNode endpoint in the test process that only records the lifecycle
orders (Delete / Demote / Promote) the master sends it and heartbeats on its behalf, so tests can assert
what the master told nodes to do. End-to-end tests with the real storage node live with the node's code.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message
from kvpool.kvstore.errors import StoreError
from kvpool.kvstore.protocol.master_wire import call_blocking
from kvpool.proto import common_pb2, master_pb2, node_pb2, node_pb2_grpc
from kvpool.runtime.spawn import spawn

DEADLINE_S = 5.0


class MasterProcess:
    """``kvpool store master`` in a child process, called through :meth:`call`."""

    def __init__(
        self, log_dir: Path, *flags: str, via_kvpool_cli: bool = False, env: dict[str, str] | None = None
    ) -> None:
        # the full `kvpool` CLI also imports the model (torch): seconds per start; same code path otherwise
        entry = ["kvpool", "store", "master"] if via_kvpool_cli else ["kvpool.kvstore.cli", "master"]
        self.child = spawn("master", [*entry, "--port", "0", *flags], log_dir, timeout_s=30.0, env=env)
        self.proc = self.child.popen
        self.log_path = self.child.log_path
        self.metrics_port: int | None = self.child.ready.get("metrics_port")
        self.port = int(self.child.ready["port"])
        self.address = f"127.0.0.1:{self.port}"

    def call(self, name: str, request: Message, timeout_s: float = DEADLINE_S) -> Any:
        """The master's reply to ``name`` (master.proto's method table), or the typed error it answered."""
        return call_blocking(self.address, name, request, timeout_s)

    def stats(self) -> master_pb2.StatsReply:
        return self.call("Stats", master_pb2.StatsRequest())

    def terminate(self, timeout_s: float = 10.0) -> int:
        return self.child.stop(timeout_s)

    def kill(self) -> None:
        self.child.kill()


class _Recorder(node_pb2_grpc.StorageNodeServicer):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, bytes]] = []
        self.refuse: set[str] = set()  # actions answered with every key "missing" (e.g. a full SSD)
        self.stall: set[str] = set()  # actions answered (and recorded) only after ``stall_s``: a hung node
        self.stall_s = 0.0

    def _record(self, action: str, request: node_pb2.KeysRequest) -> node_pb2.KeysReply:
        if action in self.stall:
            time.sleep(self.stall_s)
        with self.lock:
            self.calls.extend((action, k) for k in request.keys)
            if action in self.refuse:
                return node_pb2.KeysReply(done=0, missing=list(request.keys))
        return node_pb2.KeysReply(done=len(request.keys))

    def Delete(self, request, context):
        return self._record("delete", request)

    def Demote(self, request, context):
        return self._record("demote", request)

    def Promote(self, request, context):
        return self._record("promote", request)


class ProbeNode:
    """A registered node endpoint that records lifecycle orders and heartbeats every ``interval_s``."""

    def __init__(self, node_id: str, master: MasterProcess, dram: int, ssd: int = 0) -> None:
        self.node_id = node_id
        self.master = master
        self.dram, self.ssd = dram, ssd
        self.recorder = _Recorder()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        node_pb2_grpc.add_StorageNodeServicer_to_server(self.recorder, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = common_pb2.NodeEndpoint(node_id=node_id, host="127.0.0.1", grpc_port=self.port)
        self._stop = threading.Event()
        self._beats: threading.Thread | None = None

    def register(self, inventory: list[common_pb2.ObjectMeta] | None = None) -> master_pb2.RegisterNodeReply:
        return self.master.call(
            "RegisterNode",
            master_pb2.RegisterNodeRequest(
                node=self.endpoint,
                dram_capacity_bytes=self.dram,
                ssd_capacity_bytes=self.ssd,
                inventory=inventory or [],
            ),
        )

    def start_heartbeats(self, interval_s: float = 0.05) -> None:
        self._stop.clear()

        def beat() -> None:
            while not self._stop.wait(interval_s):
                with contextlib.suppress(StoreError):  # the master may be restarting
                    self.master.call("Heartbeat", master_pb2.HeartbeatRequest(node_id=self.node_id))

        self._beats = threading.Thread(target=beat, daemon=True)
        self._beats.start()

    def stop_heartbeats(self) -> None:
        self._stop.set()
        if self._beats is not None:
            self._beats.join(timeout=DEADLINE_S)

    def orders(self, action: str) -> list[bytes]:
        with self.recorder.lock:
            return [k for a, k in self.recorder.calls if a == action]

    def close(self) -> None:
        self.stop_heartbeats()
        self.server.stop(0)


def wait_until(predicate, timeout_s: float, interval_s: float = 0.02) -> float:
    """Poll ``predicate`` until true; returns the seconds it took, raises TimeoutError otherwise."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"condition not met within {timeout_s}s")
        time.sleep(interval_s)
