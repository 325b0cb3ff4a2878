"""The HA control plane of ``kvpool up --ha``: etcd members and the masters' election flags.

``start_etcd`` starts ``n`` etcd members on loopback (``runtime.etcd_member``: each prints a readiness
line once its member reports a quorum), all at once because a member waits for its peers. The masters then
get ``--etcd <all members> --ha-group <per run>``; ``wait_for_leader`` returns once one of them answers
``Describe`` as the leader, so everything started after it finds a leader on its first call.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

from kvpool.runtime.spawn import Child, LaunchError

Spawn = Callable[[str, str, list[str], int], Child]  # (name, role, module argv, member index) -> the child

MASTERS = 2
LEASE_TTL_S = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_etcd(
    spawn: Spawn,
    wait_ready: Callable[[Child, float], object],
    run_dir: Path,
    hosts: list[str],
    timeout_s: float,
) -> list[Child]:
    """One member per entry of ``hosts`` (its IP: 127.0.0.1 on loopback, its namespace's under --netns)."""
    ports = [(free_port(), free_port()) for _ in hosts]
    initial = ",".join(f"etcd-{i}=http://{hosts[i]}:{peer}" for i, (_port, peer) in enumerate(ports))
    etcd = [
        spawn(f"etcd-{i}", "etcd", _member_argv(run_dir, i, hosts[i], port, peer, initial), i)
        for i, (port, peer) in enumerate(ports)
    ]
    for member in etcd:
        wait_ready(member, timeout_s)
    return etcd


def _member_argv(run_dir: Path, i: int, host: str, port: int, peer: int, initial: str) -> list[str]:
    return [
        "kvpool.runtime.etcd_member",
        "--name", f"etcd-{i}",
        "--host", host,
        "--data-dir", str(run_dir / f"etcd-{i}"),
        "--port", str(port),
        "--peer-port", str(peer),
        "--initial-cluster", initial,
    ]  # fmt: skip


def master_flags(etcd: list[Child]) -> list[str]:
    group = f"run-{etcd[0].popen.pid}"
    endpoints = ",".join(f"{s.ready['host']}:{s.ready['port']}" for s in etcd)
    return ["--etcd", endpoints, "--ha-group", group, "--lease-ttl", str(LEASE_TTL_S)]


def leader_of(addresses: list[str], timeout_s: float = 1.0, key: bytes | None = None) -> str | None:
    """The address whose master says it leads (``Describe``), None if none does now."""
    from kvpool.kvstore.errors import StoreError
    from kvpool.kvstore.protocol.master_wire import call_blocking
    from kvpool.proto import master_pb2

    for address in addresses:
        try:
            reply = call_blocking(address, "Describe", master_pb2.DescribeRequest(), timeout_s, key=key)
        except StoreError:
            continue
        if reply.leader:
            return address
    return None


def wait_for_leader(addresses: list[str], timeout_s: float, key: bytes | None = None) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        leader = leader_of(addresses, key=key)
        if leader is not None:
            return leader
        time.sleep(0.1)
    raise LaunchError(f"no master of {addresses} was elected leader within {timeout_s:.0f}s")
