"""The HA control plane for real: ``kvpool up --ha --etcd-members 3`` runs three etcd members, two masters
that elect a leader through etcd, one storage node, a prefill and a decode worker and the gateway, all real
processes. The cases run in order on one cluster, each leaving it with a leader and a standby:

1. ``kvpool status --json`` names exactly one leader;
2. split brain: SIGSTOP the leader for twice its lease, the standby wins, SIGCONT the old one, and nothing is
   committed or deleted on the old leader's word (it refuses, and the node fences its epoch);
3. one etcd member killed of three: service unchanged, puts still land;
4. ``kill -9`` of the leader under a steady stream: 0 wrong tokens, 0 client errors, puts resume within
   ``PUT_RESUME_S`` and the hit rate is back to 90 % of its level within ``HITS_BACK_S``;
5. every etcd member down: the leader keeps serving reads (cache hits), refuses writes, and logs it.

Answers are greedy, so every answer must equal the cold answer of its prompt token for token.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvpool.kvstore.errors import CapacityExceededError, NotLeaderError, StoreError
from kvpool.kvstore.protocol import data_frame, master_wire
from kvpool.proto import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    master_pb2,
    node_pb2,
    node_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from kvpool.runtime import cluster_auth
from kvpool.runtime.spawn import LaunchError, spawn

from kvpool.launch.service_argv import master_argv
from tests.harness.clusters import start_up

pytestmark = pytest.mark.slow

LEASE_TTL_S = 2  # kvpool.launch.ha_cluster.LEASE_TTL_S
PUT_RESUME_S = 5.0
HITS_BACK_S = 10.0
UP_TIMEOUT_S = 150
CONFIG = """
[cluster]
ready_timeout_s = 120
[master]
heartbeat_ms = 300
node_timeout_ms = 3000
[store]
nodes = 1
capacity = "64MiB"
transport = "tcp,shm"
[prefill]
count = 1
args = ["--store-timeout", "2"]
[decode]
count = 1
args = ["--store-timeout", "2"]
[gateway]
port = 0
max_output_tokens = 16
request_timeout_s = 60.0
"""


def _prompt(tag: str) -> str:
    return f"[{tag}] " + " ".join(f"the leader keeps block {i} of {tag} in its index." for i in range(40))


class HaCluster:
    def __init__(self, popen: subprocess.Popen, run_dir: Path) -> None:
        self.popen, self.run_dir = popen, run_dir
        self.state_path = run_dir / "state.json"
        self.state = json.loads(self.state_path.read_text())
        self.url = self.state["gateway_url"]
        self.cold: dict[str, str] = {}

    def service(self, name: str) -> dict:
        return next(s for s in self.state["services"] if s["name"] == name)

    def masters(self) -> list[dict]:
        return [s for s in self.state["services"] if s["role"] == "master"]

    def chat(self, prompt: str) -> tuple[str, int, int]:
        """(answer, cached prompt tokens, prompt tokens); the answer must equal the prompt's cold answer."""
        r = httpx.post(
            f"{self.url}/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0},
            timeout=60.0,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        usage = body["usage"]
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        text = body["choices"][0]["text"]
        assert self.cold.setdefault(prompt, text) == text, f"wrong tokens for {prompt[:20]}"
        return text, cached, int(usage["prompt_tokens"])

    def describe(self, address: str) -> master_pb2.DescribeReply | None:
        try:
            return master_wire.call_blocking(address, "Describe", master_pb2.DescribeRequest(), 1.0)
        except StoreError:
            return None

    def leader(self, timeout_s: float = 15.0, not_pid: int | None = None) -> dict:
        """The master that says it leads (waiting for one, other than ``not_pid``, up to ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for m in self.masters():
                if m["pid"] != not_pid:
                    d = self.describe(m["address"])
                    if d is not None and d.leader:
                        return {**m, "epoch": d.epoch}
            time.sleep(0.05)
        raise AssertionError(f"no leader within {timeout_s}s")

    def master_call(self, address: str, method: str, request: Message) -> Any:
        return master_wire.call_blocking(address, method, request, 2.0)

    def counters(self, address: str) -> dict[str, int]:
        return dict(self.master_call(address, "Stats", master_pb2.StatsRequest()).counters)

    def node_keys(self) -> set[bytes]:
        with cluster_auth.sync_channel(self.service("node-0")["address"]) as ch:
            stub = node_pb2_grpc.StorageNodeStub(ch)
            return {m.key for m in stub.Inventory(node_pb2.InventoryRequest(), timeout=5.0)}

    def log(self, name: str) -> str:
        return Path(self.service(name)["log"]).read_text(errors="replace")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HaCluster]:
    base = tmp_path_factory.mktemp("ha")
    popen, run_dir = start_up(base, CONFIG, "--ha", "--etcd-members", "3", timeout_s=UP_TIMEOUT_S)
    c = HaCluster(popen, run_dir)
    cluster_auth.configure(cluster_auth.read_secret_file(c.state["secret_file"]))  # this process is a client
    try:
        yield c
    finally:
        cluster_auth.configure(None)
        for m in c.masters():  # a case that failed mid-freeze must not leave a stopped process behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(m["pid"], signal.SIGCONT)
        popen.send_signal(signal.SIGTERM)
        assert popen.wait(60) == 0, (base / "up.log").read_text()[-3000:]


def test_status_names_one_leader_and_every_master_pid(cluster: HaCluster) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvpool", "status", "--json", "--state", str(cluster.state_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    masters = [s for s in json.loads(r.stdout)["services"] if s["role"] == "master"]
    assert len(masters) == 2 and sorted(m["leader"] for m in masters) == [False, True]
    assert {m["pid"] for m in masters} == {m["pid"] for m in cluster.masters()}
    assert len([s for s in json.loads(r.stdout)["services"] if s["role"] == "etcd"]) == 3
    prompt = _prompt("status")
    _, cached, _ = cluster.chat(prompt)
    _, cached2, _ = cluster.chat(prompt)
    assert cached == 0 and cached2 > 0


def test_a_master_whose_shard_flags_disagree_with_the_fleets_in_etcd_never_serves(
    cluster: HaCluster, tmp_path: Path
) -> None:
    """The fleet's shard set is one etcd key, written by its first master ("1x2" here): a master started
    into the same group with ``--shards 2`` exits with both values named, and writes nothing."""
    ha = cluster.leader()["ready"]["ha"]
    flags = ("--etcd", ha["etcd"], "--ha-group", ha["group"], "--shards", "2", "--shard", "0")
    argv = master_argv(extra=flags)
    env = {cluster_auth.ENV_FILE: cluster.state["secret_file"]}
    with pytest.raises(LaunchError) as failed:
        spawn("master", argv, tmp_path, 30.0, env=env)
    message = str(failed.value)
    assert f"etcd's /kvpool/{ha['group']}/shard-set has 1 shard at depth 2" in message
    assert "this master's flags has 2 shards at depth 2" in message
    assert cluster.leader()["pid"] in {m["pid"] for m in cluster.masters()}  # the fleet is untouched


def _refused_then_closed(address: tuple[str, int], payload: bytes) -> bool:
    """Send ``payload`` on a fresh raw connection; True when the peer answers only its refusal (the
    UnauthenticatedError frame, ``refused the connection``) and closes the connection."""
    answer = b""
    with socket.create_connection(address, timeout=5.0) as sock:
        sock.sendall(payload)
        sock.settimeout(5.0)
        try:
            while chunk := sock.recv(1 << 16):
                answer += chunk
        except ConnectionResetError:
            pass
    return b"refused the connection" in answer and len(answer) < 4096


def test_a_peer_without_the_cluster_secret_is_rejected_on_every_listener_and_writes_nothing(
    cluster: HaCluster, tmp_path: Path
) -> None:
    leader, node = cluster.leader(), cluster.service("node-0")
    kept = cluster.node_keys()
    key = b"M" + os.urandom(32)
    meta = common_pb2.ObjectMeta(key=key, kind=common_pb2.MLA_BLOCK, size=64, checksum=1)
    grpc_calls = [
        (
            node["address"],
            node_pb2_grpc.StorageNodeStub,
            "Delete",
            node_pb2.KeysRequest(keys=sorted(kept)[:1]),
        ),
        (
            cluster.service("prefill-0")["address"],
            prefill_pb2_grpc.PrefillStub,
            "Prefill",
            prefill_pb2.PrefillRequest(),
        ),
        (
            cluster.service("decode-0")["address"],
            decode_pb2_grpc.DecodeStub,
            "Generate",
            decode_pb2.GenerateRequest(),
        ),
    ]
    for address, stub_type, method, request in grpc_calls:
        for channel in (
            grpc.insecure_channel(address),
            cluster_auth.sync_channel(address, key=os.urandom(32)),
        ):
            with channel, pytest.raises(grpc.RpcError) as err:
                reply = getattr(stub_type(channel), method)(request, timeout=5.0)
                list(reply) if method == "Generate" else reply  # a stream fails on its first read
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, err.value)
        with grpc.insecure_channel(address) as ch:  # liveness stays open to probes
            assert (
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5.0).status == 1
            )
    # raw listeners: a frame without the hello, or after a hello made with another secret, is never read (the
    # peer is answered its refusal, UnauthenticatedError, and the connection closed)
    host, wire_port = master_wire.split_address(leader["address"])
    wire_frame = master_wire.encode(1, 0, 1, master_pb2.PutStartRequest(meta=meta).SerializeToString())
    header = node_pb2.PutHeader(put_id="x", meta=meta).SerializeToString()
    put_frame = data_frame.encode(
        data_frame.Frame(data_frame.OP_PUT, key=key, aux=header, request_id=1, payload_len=64, checksum=1)
    ) + bytes(64)
    node_tcp = (node["ready"]["host"], int(node["ready"]["tcp_port"]))
    forged = cluster_auth.hello(os.urandom(32))
    for address, frame in (((host, wire_port), wire_frame), (node_tcp, put_frame)):
        assert _refused_then_closed(address, frame)
        assert _refused_then_closed(address, forged + frame)
    # a storage node started without the secret never joins the cluster: it stops and says why
    stranger = subprocess.Popen(
        [sys.executable, "-m", "kvpool.kvstore.cli", "node", "--master", cluster.state["master_address"],
         "--capacity", "16MiB", "--transport", "tcp"],
        stdout=(tmp_path / "stranger.log").open("wb"), stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_CLUSTER_SECRET")},
    )  # fmt: skip
    try:
        assert stranger.wait(30) != 0
        assert "no cluster secret" in (tmp_path / "stranger.log").read_text()
        assert cluster.master_call(leader["address"], "Stats", master_pb2.StatsRequest()).nodes == 1
    finally:
        stranger.kill()
        stranger.wait(10)
    assert key not in cluster.node_keys() and kept <= cluster.node_keys()
    counters = cluster.counters(leader["address"])
    # the two frames above (the stranger node may have knocked on a standby: its refusal is shown by its log)
    assert counters.get("auth_rejected_master_wire", 0) >= 2
    with cluster_auth.sync_channel(node["address"]) as ch:
        info = node_pb2_grpc.StorageNodeStub(ch).Info(node_pb2.NodeInfoRequest(), timeout=5.0)
    assert info.counters["auth_rejected_node_tcp"] >= 2 and info.counters["auth_rejected_grpc"] >= 2


def test_a_leader_frozen_past_its_lease_is_fenced_and_commits_or_deletes_nothing(cluster: HaCluster) -> None:
    old = cluster.leader()
    warm = _prompt("split-brain")
    cluster.chat(warm)
    os.kill(old["pid"], signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        new = cluster.leader(timeout_s=4 * LEASE_TTL_S + 5, not_pid=old["pid"])
        assert new["epoch"] > old["epoch"]
        time.sleep(max(0.0, 2 * LEASE_TTL_S - (time.monotonic() - t0)))
        for i in range(3):  # the cluster runs on the new leader: puts land, hits return
            cluster.chat(_prompt(f"under-new-leader-{i}"))
        deadline = time.monotonic() + HITS_BACK_S
        while cluster.chat(warm)[1] == 0:
            assert time.monotonic() < deadline, "no hit under the new leader"
            time.sleep(0.3)
        kept = cluster.node_keys()
        assert kept
    finally:
        os.kill(old["pid"], signal.SIGCONT)
    victim = sorted(kept)[0]
    meta = common_pb2.ObjectMeta(key=b"M" + os.urandom(32), kind=common_pb2.MLA_BLOCK, size=64, checksum=1)
    writes = [
        ("PutStart", master_pb2.PutStartRequest(meta=meta)),
        ("Remove", master_pb2.RemoveRequest(keys=[victim])),
        ("SetQuota", master_pb2.SetQuotaRequest(tenant="t", max_bytes=1)),
    ]
    for method, request in writes:  # the old leader, awake: every write refused, naming the leader
        with pytest.raises(NotLeaderError):
            cluster.master_call(old["address"], method, request)
    # the node fences the old epoch too: a Delete ordered under it is refused and deletes nothing
    with cluster_auth.sync_channel(cluster.service("node-0")["address"]) as ch:
        stub = node_pb2_grpc.StorageNodeStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Delete(node_pb2.KeysRequest(keys=[victim], epoch=old["epoch"]), timeout=2.0)
    assert (
        err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "StaleEpochError" in err.value.details()
    )
    time.sleep(LEASE_TTL_S)
    assert kept <= cluster.node_keys(), "an object was deleted on the deposed leader's word"
    d = cluster.describe(old["address"])
    assert d is not None and not d.leader and d.leader_address == new["address"]
    assert cluster.leader()["pid"] == new["pid"]
    assert cluster.chat(warm)[1] > 0


def test_one_etcd_member_down_of_three_changes_nothing(cluster: HaCluster) -> None:
    leader = cluster.leader()
    member = cluster.service("etcd-2")
    os.kill(int(member["ready"]["etcd_pid"]), signal.SIGKILL)
    before = cluster.counters(leader["address"]).get("puts_committed", 0)
    for i in range(3):
        cluster.chat(_prompt(f"two-of-three-{i}"))
    time.sleep(3 * LEASE_TTL_S)  # several lease refreshes on the remaining quorum
    assert cluster.leader()["pid"] == leader["pid"]
    assert cluster.counters(leader["address"]).get("puts_committed", 0) > before


@dataclass
class Stream:
    """Requests back to back: a warm prompt (hit rate), then a fresh one (puts). Records per request."""

    cluster: HaCluster
    warm: list[str]
    samples: list[tuple[float, float]] = field(default_factory=list)  # (start, cached share) per warm prompt
    fresh: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            try:
                started = time.monotonic()
                _, cached, total = self.cluster.chat(self.warm[i % len(self.warm)])
                self.samples.append((started, cached / total))
                prompt = _prompt(f"fresh-{i}")
                self.cluster.chat(prompt)
                self.fresh.append(prompt)
            except (AssertionError, httpx.HTTPError) as exc:
                self.errors.append(repr(exc))
            i += 1


def test_kill_9_of_the_leader_under_load_loses_no_tokens_and_recovers_in_seconds(cluster: HaCluster) -> None:
    warm = [_prompt(f"steady-{i}") for i in range(3)]
    for p in warm:
        cluster.chat(p)
    leader = cluster.leader()
    standby = next(m for m in cluster.masters() if m["pid"] != leader["pid"])
    capped = master_pb2.SetQuotaRequest(tenant="capped", max_bytes=4096)  # lives in etcd: must survive
    cluster.master_call(leader["address"], "SetQuota", capped)
    stream = Stream(cluster, warm)
    thread = threading.Thread(target=stream.run, daemon=True)
    thread.start()
    try:
        time.sleep(3.0)
        before = [share for _, share in stream.samples]
        level = sum(before) / len(before)
        assert level > 0.5, before
        t_kill = time.monotonic()
        os.kill(leader["pid"], signal.SIGKILL)
        put_at = None
        while put_at is None and time.monotonic() - t_kill < 3 * PUT_RESUME_S:
            with contextlib.suppress(StoreError):
                if cluster.counters(standby["address"]).get("puts_committed", 0) > 0:
                    put_at = time.monotonic() - t_kill
            time.sleep(0.05)
        back_at = None
        while back_at is None and time.monotonic() - t_kill < 2 * HITS_BACK_S:
            # the first warm request *started* after the kill that is served at 90 % of the old level
            back = [t for t, share in stream.samples if t > t_kill and share >= 0.9 * level]
            if back:
                back_at = back[0] - t_kill
            time.sleep(0.1)
    finally:
        stream.stop.set()
        thread.join(120)
    print(f"\nHA failover: first committed put {put_at}s after kill -9, hit rate back in {back_at}s")
    assert stream.errors == []
    assert put_at is not None and put_at <= PUT_RESUME_S, put_at
    assert back_at is not None and back_at <= HITS_BACK_S, back_at
    for p in stream.fresh[-3:]:  # asked again: now served from cache, token for token the cold answer
        cluster.chat(p)
    big = common_pb2.ObjectMeta(
        key=b"M" + os.urandom(32), kind=common_pb2.MLA_BLOCK, size=1 << 20, checksum=1, tenant="capped"
    )
    with pytest.raises(CapacityExceededError, match="quota"):  # the new leader enforces the old one's quota
        cluster.master_call(standby["address"], "PutStart", master_pb2.PutStartRequest(meta=big))
    cluster.state["services"] = [s for s in cluster.state["services"] if s["pid"] != leader["pid"]]


def test_with_every_etcd_member_down_the_leader_serves_reads_and_refuses_writes(cluster: HaCluster) -> None:
    leader = cluster.leader()
    warm = _prompt("etcd-gone")
    cluster.chat(warm)
    assert cluster.chat(warm)[1] > 0
    for name in ("etcd-0", "etcd-1", "etcd-2"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(cluster.service(name)["ready"]["etcd_pid"]), signal.SIGKILL)
    deadline = time.monotonic() + 2 * LEASE_TTL_S + 5  # read-only once its lease ran out: awaited, not slept
    while "serving reads only" not in cluster.log(leader["name"]):
        assert time.monotonic() < deadline, "the leader never said it serves reads only"
        time.sleep(0.1)
    _, cached, _ = cluster.chat(warm)  # reads: still a hit, same tokens
    assert cached > 0
    cluster.chat(_prompt("etcd-gone-fresh"))  # a write: refused by the master, recomputed, no error
    with pytest.raises(NotLeaderError, match="read-only \\(etcd unreachable\\)"):
        cluster.master_call(
            leader["address"], "SetQuota", master_pb2.SetQuotaRequest(tenant="t", max_bytes=1)
        )
    assert "serving reads only" in cluster.log(leader["name"])
