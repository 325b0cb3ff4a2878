"""The pieces under ``kvpool up --netns``, each on its own: link specs, the topology and its teardown, the
stale-namespace sweep, the delay relay and the fault rules, on real namespaces (root; a box that cannot
build them fails these cases with the reason)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpool.kvstore.protocol.shm_segment import host_id
from kvpool.runtime import netfaults
from kvpool.runtime.netns import (
    BRIDGE_PREFIX,
    NS_PREFIX,
    Host,
    LinkSpec,
    Topology,
    run,
    sweep_stale,
)
from kvpool.runtime.spawn import LaunchError, start, wait_ready

from kvpool.launch.placement import make_placement


def test_link_specs_parse_and_bad_ones_say_what_is_wrong() -> None:
    spec = LinkSpec.parse("delay 200us jitter 50us rate 10gbit loss 0.5%")
    assert spec == LinkSpec(delay_ms=0.2, jitter_ms=0.05, rate_bps=10e9, loss_pct=0.5)
    assert spec.needs_relay and not LinkSpec.parse("rate 1gbit").needs_relay
    assert LinkSpec.parse("") == LinkSpec()
    for bad, why in [
        ("delay", "pairs"),
        ("delay 5 parsecs", "expected 'key value'"),
        ("delay 5", "us, ms or s"),
        ("rate fast", "10gbit"),
        ("loss 120%", "0-100"),
        ("mtu 9000", "unknown key 'mtu'"),
    ]:
        with pytest.raises(ValueError, match=why):
            LinkSpec.parse(bad)


def test_netns_needs_root_and_link_needs_netns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(LaunchError, match="--link shapes namespace links: it needs --netns"):
        make_placement(tmp_path, False, "delay 1ms")
    with pytest.raises(LaunchError, match="unknown key"):
        make_placement(tmp_path, True, "bogus 1")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(LaunchError, match="--netns needs root"):
        make_placement(tmp_path, True, None)


@pytest.fixture()
def topo() -> Iterator[Topology]:
    t = Topology.create()
    try:
        yield t
    finally:
        t.destroy()


def _netns_list() -> set[str]:
    return {line.split()[0] for line in run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()}


def _links() -> str:
    return run(["ip", "-o", "link", "show"]).stdout


def test_hosts_get_their_own_stack_and_teardown_removes_everything(topo: Topology) -> None:
    a, b = topo.add_host("a"), topo.add_host("b")
    assert a.ip != b.ip and {a.netns, b.netns} <= _netns_list()
    out = subprocess.run(
        [
            *a.exec_prefix(),
            sys.executable,
            "-c",
            "from kvpool.kvstore.protocol.shm_segment import host_id; print(host_id())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.strip() != host_id()  # another namespace is another host
    server = subprocess.Popen(
        [*b.exec_prefix(), sys.executable, "-c", _ECHO_SERVER.format(ip=b.ip)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        reply = subprocess.run(
            [*a.exec_prefix(), sys.executable, "-c", _ECHO_CLIENT.format(ip=b.ip)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert reply.stdout.strip() == "pong", reply.stderr
    finally:
        server.kill()
        server.wait()
    topo.destroy()
    assert not {a.netns, b.netns} & _netns_list()
    assert topo.bridge not in _links() and a.veth not in _links()


_ECHO_SERVER = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("{ip}", 7007))
s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(c.recv(64).replace(b"ping", b"pong")); c.close()
"""
_ECHO_CLIENT = """
import socket
c = socket.create_connection(("{ip}", 7007), timeout=5); c.sendall(b"ping"); print(c.recv(64).decode())
"""


def test_the_sweep_removes_what_a_dead_launcher_left_and_spares_live_ones(topo: Topology) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Topology.create(tag=dead.pid)
    stale.add_host("x")
    live = topo.add_host("alive")
    removed = sweep_stale()
    assert f"{NS_PREFIX}{dead.pid}-x" in removed and f"{BRIDGE_PREFIX}{dead.pid}" in removed
    assert f"{NS_PREFIX}{dead.pid}-x" not in _netns_list() and live.netns in _netns_list()


def _rtt_ms(client_ns: list[str], ip: str, port: int, n: int = 5) -> float:
    code = (
        "import socket,time\n"
        f"c=socket.create_connection(('{ip}',{port}),timeout=10)\n"
        "c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
        "best=1e9\n"
        f"for _ in range({n}):\n"
        "    t=time.perf_counter(); c.sendall(b'x'); c.recv(1); best=min(best,time.perf_counter()-t)\n"
        "print(best*1e3)\n"
    )
    out = subprocess.run([*client_ns, sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return float(out.stdout)


_BYTE_ECHO = """
import socket, threading
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("{ip}", {port}))
s.listen()
print("ready", flush=True)
def serve(c):
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (d := c.recv(1)):
        c.sendall(d)
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""


def _start_echo(host: Host, port: int) -> subprocess.Popen:
    """A byte-echo server in ``host``'s namespace, returned once it listens."""
    echo = subprocess.Popen(
        [*host.exec_prefix(), sys.executable, "-c", _BYTE_ECHO.format(ip=host.ip, port=port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
    return echo


def test_the_relay_adds_both_links_delays_and_follows_changes_live(topo: Topology, tmp_path: Path) -> None:
    a, b = topo.add_host("a"), topo.add_host("b")
    control = tmp_path / "delays.json"
    netfaults.write_delay(control, a.ip, 5.0)
    netfaults.write_delay(control, b.ip, 10.0)
    relay = start("relay", ["kvpool.runtime.netrelay", "--control", str(control), "--self-ip", a.ip],
                  tmp_path / "relay.log", prefix=a.exec_prefix())  # fmt: skip
    echo = _start_echo(b, 7008)
    try:
        wait_ready(relay, 30)
        bare = _rtt_ms(a.exec_prefix(), b.ip, 7008)
        netfaults.install_redirect(a, int(relay.ready["port"]))
        delayed = _rtt_ms(a.exec_prefix(), b.ip, 7008)
        assert 30.0 <= delayed < 30.0 + 25.0 and bare < 5.0  # 2 x (5 + 10) ms per round trip
        netfaults.write_delay(control, b.ip, 0.0)
        followed_by = time.monotonic() + 5.0  # the relay polls its control file every 50 ms
        while (live := _rtt_ms(a.exec_prefix(), b.ip, 7008)) >= 30.0 and time.monotonic() < followed_by:
            pass
        assert 10.0 <= live < 30.0  # b's 10 ms are gone both ways (noise is retried, not tolerated)
    finally:
        relay.kill()
        echo.kill()
        echo.wait()


def test_partition_drops_silently_loss_drops_some_and_heal_restores(topo: Topology) -> None:
    a, b = topo.add_host("a"), topo.add_host("b")
    for h in (a, b):
        netfaults.install_chains(h)
    echo = _start_echo(b, 7009)
    try:
        connect = (
            "import socket,time\nt=time.monotonic()\n"
            f"try:\n    socket.create_connection(('{b.ip}',7009),timeout=1.0); print('ok')\n"
            "except OSError as e:\n    print(type(e).__name__, round(time.monotonic()-t,1))\n"
        )

        def attempt() -> str:
            return subprocess.run(
                [*a.exec_prefix(), sys.executable, "-c", connect], capture_output=True, text=True, timeout=60
            ).stdout.strip()

        assert attempt() == "ok"
        netfaults.partition(b)
        assert attempt() in ("TimeoutError 1.0", "timeout 1.0")  # silence, not a refusal
        netfaults.heal(b)
        assert attempt() == "ok"
        netfaults.loss(b, 100.0)
        assert attempt().endswith("1.0")
        netfaults.heal(b, baseline_loss_pct=0.0)
        assert attempt() == "ok"
        rules = run(["ip", "netns", "exec", b.netns, "iptables", "-S", netfaults.CHAIN_IN]).stdout
        assert "DROP" not in rules
    finally:
        echo.kill()
        echo.wait()


def test_a_frozen_peer_keeps_its_link_up(topo: Topology) -> None:
    """SIGSTOP leaves the kernel answering the handshake: the half-open case the deadlines must bound."""
    b = topo.add_host("b")
    echo = _start_echo(b, 7010)
    try:
        os.kill(echo.pid, 19)  # SIGSTOP
        sock = socket.create_connection((b.ip, 7010), timeout=2)  # from the root namespace, via the bridge
        sock.settimeout(0.5)
        sock.sendall(b"x")
        with pytest.raises(TimeoutError):
            sock.recv(1)
        sock.close()
    finally:
        os.kill(echo.pid, 18)  # SIGCONT
        echo.kill()
        echo.wait()
