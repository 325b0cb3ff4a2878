"""HA across a real network: ``kvpool up --ha --netns --link "delay 200us"`` puts the etcd member, both
masters, the node and the workers each in its own namespace. Partitioning the leader is the failure a
pause cannot show: the old leader keeps running, cut off from etcd and from everyone else, and must stop
acting on its own; the standby must win and the cluster must move to it; after the heal the old leader must
find itself deposed, not resume. Every answer equals its prompt's cold answer throughout.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpool.runtime import cluster_auth

from tests.harness.clusters import start_up
from tests.test_ha_control_plane import HaCluster, _prompt

pytestmark = pytest.mark.slow

TAKEOVER_S = 15.0  # partition -> a fresh prompt is cached through the new leader (lease 2 s + store timeouts)
CONFIG = """
[cluster]
ready_timeout_s = 150
[master]
heartbeat_ms = 300
node_timeout_ms = 3000
[store]
nodes = 1
capacity = "64MiB"
transport = "tcp"
[prefill]
count = 1
transport = "tcp"
args = ["--store-timeout", "2"]
[decode]
count = 1
transport = "tcp"
args = ["--store-timeout", "2"]
[gateway]
port = 0
max_output_tokens = 16
request_timeout_s = 60.0
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HaCluster]:
    base = tmp_path_factory.mktemp("ha-netns")
    popen, run_dir = start_up(base, CONFIG, "--ha", "--netns", "--link", "delay 200us", timeout_s=180)
    c = HaCluster(popen, run_dir)
    cluster_auth.configure(cluster_auth.read_secret_file(c.state["secret_file"]))
    try:
        yield c
    finally:
        cluster_auth.configure(None)
        chaos(c, "heal")
        popen.send_signal(signal.SIGTERM)
        assert popen.wait(60) == 0, (base / "up.log").read_text()[-3000:]


def chaos(c: HaCluster, *args: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvpool", "chaos", *args, "--state", str(c.state_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr


def test_every_control_plane_service_has_its_own_namespace(cluster: HaCluster) -> None:
    names = {s["name"]: s for s in cluster.state["services"]}
    control = [names[n] for n in ("etcd-0", "master-0", "master-1")]
    assert len({s["netns"] for s in control}) == 3 and all(s["ip"].startswith("10.") for s in control)
    assert all(a.startswith("10.") for a in cluster.state["master_address"].split(","))


def test_a_partitioned_leader_is_replaced_and_finds_itself_deposed_after_the_heal(cluster: HaCluster) -> None:
    old = cluster.leader()
    warm = _prompt("netns-warm")
    cluster.chat(warm)
    assert cluster.chat(warm)[1] > 0
    chaos(cluster, "partition", old["name"])
    t0 = time.monotonic()
    i = 0
    while True:  # fresh prompts until one is cached: puts land again, through the new leader
        fresh = _prompt(f"netns-fresh-{i}")
        cluster.chat(fresh)
        if cluster.chat(fresh)[1] > 0:
            break
        assert time.monotonic() - t0 < TAKEOVER_S, "no put landed through a new leader"
        i += 1
    took = time.monotonic() - t0
    new = cluster.leader(not_pid=old["pid"])
    assert new["epoch"] > old["epoch"]
    assert cluster.chat(warm)[1] > 0
    chaos(cluster, "heal")
    deadline = time.monotonic() + 10
    while "deposed" not in Path(old["log"]).read_text():
        assert time.monotonic() < deadline, "the healed old leader did not find itself deposed"
        time.sleep(0.2)
    while True:  # a standby again: it names the new leader once its next campaign has read the key
        d = cluster.describe(old["address"])
        assert d is not None and not d.leader, d
        if d.leader_address == new["address"]:
            break
        assert time.monotonic() < deadline, d
        time.sleep(0.2)
    assert cluster.leader()["pid"] == new["pid"]
    assert cluster.chat(warm)[1] > 0
    print(f"\nHA netns: partition of the leader -> a put landed through the new one in {took:.2f}s")
