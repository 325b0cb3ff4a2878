"""Every service's own Prometheus ``/metrics`` (``--metrics-port``): prefill and decode workers, storage
nodes and the gateway as real processes (one module cluster as ``kvpool up`` starts it, and standalone
nodes), scraped with httpx before and after real traffic."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
from pathlib import Path

import grpc
import httpx
import pytest
import xxhash
import yaml
from kvpool.kvstore.transport.selector import TransportSelector
from kvpool.proto import common_pb2, node_pb2, node_pb2_grpc
from kvpool.runtime import cluster_auth
from kvpool.worker.client import DisaggClient
from kvpool.worker.handoff import PrefillRequest
from kvpool.worker.sampling import SamplingParams
from prometheus_client.parser import text_string_to_metric_families
from store_helpers import location, start_node

from kvpool.commands.status import run_status
from kvpool.launch.cluster import Cluster
from kvpool.launch.config import load_config, merge_config
from tests.harness.clusters import WORKER_CLUSTER

Samples = dict[tuple[str, frozenset], float]


def scrape(host: str, port: int) -> Samples:
    return scrape_url(f"http://{host}:{port}/metrics")


def scrape_url(url: str) -> Samples:
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def metrics_addr(ready: dict) -> tuple[str, int]:
    assert isinstance(ready.get("metrics_port"), int) and ready["metrics_port"] > 0, ready
    return ready.get("host", "127.0.0.1"), ready["metrics_port"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One cluster for the module, as ``kvpool up`` starts it (gateway, cluster secret, published as the
    current run for ``kvpool status``), with ``worker_cluster``'s services and settings (workers on tcp):
    every service's metrics_port is on."""
    base = tmp_path_factory.mktemp("metrics")
    config = load_config(overrides=merge_config(WORKER_CLUSTER, {"gateway": {"port": 0}}))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KVPOOL_RUNS", str(base / "runs"))
        with Cluster(config, base / "run") as c:
            yield c


def test_prefill_decode_and_node_metrics_move_with_a_conversation(cluster) -> None:
    prefill = metrics_addr(cluster.services["prefill-0"].ready)
    decode = metrics_addr(cluster.services["decode-0"].ready)
    node = metrics_addr(cluster.services["node-0"].ready)
    p0, d0, n0 = scrape(*prefill), scrape(*decode), scrape(*node)
    assert val(p0, "kvpool_prefill_requests_total", status="ok") == 0
    assert val(d0, "kvpool_decode_requests_total", status="ok") == 0
    assert val(p0, "kvpool_worker_info", role="prefill", model="tiny") == 1

    first = [(7 * i + 3) % 250 + 1 for i in range(200)]
    second = first + [(11 * i + 5) % 250 + 1 for i in range(60)]  # extends it: reuses its blocks
    params = SamplingParams(max_tokens=70, ignore_eos=True)  # 200 + 69 consumed: decode pushes a block

    async def go():
        client = DisaggClient(cluster.address("prefill-0"), cluster.address("decode-0"), timeout_s=60)
        try:
            return [
                await client.complete(PrefillRequest(f"m{i}", p, "tenant", params), return_logits=False)
                for i, p in enumerate((first, second))
            ]
        finally:
            await client.close()

    cluster_auth.configure(cluster_auth.read_secret_file(str(cluster.secret_file)))  # a client of the run
    try:
        done = asyncio.run(go())
    finally:
        cluster_auth.configure(None)  # the standalone nodes below have no secret
    p1, d1, n1 = scrape(*prefill), scrape(*decode), scrape(*node)

    # prefill: one outcome per request, token accounting equal to what the replies reported
    assert val(p1, "kvpool_prefill_requests_total", status="ok") == 2
    assert val(p1, "kvpool_prefill_prompt_tokens_total") == len(first) + len(second)
    cached = sum(c.prefill.cached_tokens for c in done)
    assert cached > 0 and val(p1, "kvpool_prefill_cached_tokens_total") == cached
    assert val(p1, "kvpool_prefill_computed_tokens_total") == len(first) + len(second) - cached
    assert val(p1, "kvpool_prefill_lost_to_checkpoint_tokens_total") == sum(
        c.prefill.lost_to_checkpoint_tokens for c in done
    )
    for h in ("fetch", "compute", "push", "ttft"):
        assert val(p1, f"kvpool_prefill_{h}_seconds_count") == 2, h
    assert val(p1, "kvpool_prefill_compute_seconds_sum") > 0
    assert val(p1, "kvpool_prefill_transfer_bytes_total", direction="fetched") > 0  # the second one hit
    assert val(p1, "kvpool_prefill_transfer_bytes_total", direction="pushed") > 0
    assert val(p1, "kvpool_prefill_queue_depth") == 0
    assert val(p1, "kvpool_prefill_cache_errors_total", kind="corrupt") == 0

    # decode: tokens streamed, batched steps timed, output blocks + end-of-output checkpoint pushed
    assert val(d1, "kvpool_decode_requests_total", status="ok") == 2
    assert val(d1, "kvpool_decode_output_tokens_total") == sum(len(c.tokens) for c in done) == 140
    assert val(d1, "kvpool_decode_batch_size_sum") == sum(len(c.tokens) - 1 for c in done)
    assert val(d1, "kvpool_decode_step_seconds_count") >= 69
    assert val(d1, "kvpool_decode_active_requests") == 0
    blocks = sum(c.decode.blocks_pushed for c in done)
    assert blocks > 0 and val(d1, "kvpool_decode_pushes_total", kind="blocks") == blocks
    assert val(d1, "kvpool_decode_pushes_total", kind="checkpoint") == sum(
        1 for c in done if c.decode.checkpoint_pushed
    )
    assert val(d1, "kvpool_decode_request_seconds_count") == 2
    assert val(d1, "kvpool_decode_resumes_total", path="tail") == 2

    # node: what the workers pushed landed over tcp (worker_cluster's transport) and the reuse read it back
    assert val(n1, "kvpool_node_transport_bytes_total", transport="tcp", direction="in") > val(
        n0, "kvpool_node_transport_bytes_total", transport="tcp", direction="in"
    )
    assert val(n1, "kvpool_node_transport_bytes_total", transport="tcp", direction="out") > 0
    assert val(n1, "kvpool_node_objects", tier="dram") > 0
    assert (
        0 < val(n1, "kvpool_node_dram_used_bytes") <= val(n1, "kvpool_node_dram_capacity_bytes") == 256 << 20
    )
    assert val(n1, "kvpool_node_events_total", event="puts") > 0
    assert val(n1, "kvpool_node_checksum_failures_total", where="put") == 0

    r = httpx.get(f"http://{prefill[0]}:{prefill[1]}/nope", timeout=10)
    assert r.status_code == 404


def test_node_metrics_count_shm_ssd_tiers_and_checksum_failures(tmp_path) -> None:
    node = start_node(
        tmp_path,
        None,
        "4MiB",
        "tcp,shm",
        "--ssd-path",
        str(tmp_path / "ssd"),
        "--ssd-capacity",
        "8MiB",
        "--metrics-port",
        "0",
    )
    try:
        addr = metrics_addr(node.ready)
        blobs = [os.urandom(100_000) for _ in range(4)]
        metas = [
            common_pb2.ObjectMeta(
                key=b"B" + os.urandom(16),
                kind=common_pb2.BLOB,
                size=len(b),
                checksum=xxhash.xxh3_64_intdigest(b),
            )
            for b in blobs
        ]

        async def traffic() -> None:
            pairs_all = list(zip(metas, blobs, strict=True))
            for choice, pairs in (("tcp", pairs_all[:2]), ("shm", pairs_all[2:])):
                # gets from a second reader: the putter's own shm gets would be served from the node's
                # generation stamps with no LOCATE, which the node cannot count
                sel, reader = TransportSelector(choice), TransportSelector(choice)
                try:
                    t = sel.for_node(node.endpoint)
                    for m, b in pairs:
                        await t.put(node.endpoint, "p", m, b)
                        out = bytearray(m.size)
                        await reader.for_node(node.endpoint).get_into(location(node, m), out)
                finally:
                    await sel.close()
                    await reader.close()
            bad = common_pb2.ObjectMeta(key=b"Bbad", kind=common_pb2.BLOB, size=10, checksum=1)
            sel = TransportSelector("tcp")
            try:
                with pytest.raises(Exception):  # noqa: B017 - the typed error is the transport's business
                    await sel.for_node(node.endpoint).put(node.endpoint, "bad", bad, b"0123456789")
            finally:
                await sel.close()
            async with grpc.aio.insecure_channel(node.grpc_target) as ch:
                stub = node_pb2_grpc.StorageNodeStub(ch)
                r = await stub.Demote(node_pb2.KeysRequest(keys=[metas[0].key, metas[1].key]))
                assert r.done == 2
                r = await stub.Promote(node_pb2.KeysRequest(keys=[metas[0].key]))
                assert r.done == 1

        asyncio.run(traffic())
        s = scrape(*addr)
        two = 2 * 100_000
        assert val(s, "kvpool_node_transport_bytes_total", transport="tcp", direction="in") == two
        assert val(s, "kvpool_node_transport_bytes_total", transport="tcp", direction="out") == two
        assert val(s, "kvpool_node_transport_bytes_total", transport="shm", direction="in") == two
        assert val(s, "kvpool_node_transport_bytes_total", transport="shm", direction="out") >= two
        assert val(s, "kvpool_node_checksum_failures_total", where="put") == 1
        assert val(s, "kvpool_node_demotions_total") == 2 and val(s, "kvpool_node_promotions_total") == 1
        assert (
            val(s, "kvpool_node_objects", tier="dram") == 3 and val(s, "kvpool_node_objects", tier="ssd") == 1
        )
        assert val(s, "kvpool_node_ssd_used_bytes") == 100_000
        assert val(s, "kvpool_node_ssd_capacity_bytes") == 8 << 20
        assert val(s, "kvpool_node_dram_used_bytes") >= 3 * 100_000
        assert 0 <= val(s, "kvpool_node_fragmentation") <= 1
    finally:
        node.stop()


def test_metrics_are_off_without_the_flag(tmp_path) -> None:
    node = start_node(tmp_path, None, "4MiB", "tcp")
    try:
        assert node.ready["metrics_port"] is None
    finally:
        node.stop()


def test_kvpool_up_wires_every_metrics_port_and_status_shows_them(cluster, capsys) -> None:
    """The module's cluster, started with a gateway and published as ``kvpool up`` does: one request through
    the gateway moves each worker's request counter by one (the first case's two requests came before it)."""
    urls = {s.name: s.metrics_url for s in cluster.services.values()}
    assert set(urls) == {"master", "node-0", "prefill-0", "decode-0", "gateway"} and all(urls.values()), urls
    ok = {"prefill-0": "kvpool_prefill_requests_total", "decode-0": "kvpool_decode_requests_total"}
    before = {name: val(scrape_url(urls[name]), metric, status="ok") for name, metric in ok.items()}
    r = httpx.post(
        cluster.base_url + "/v1/completions",
        json={"model": "tiny", "prompt": "hello metrics " * 20, "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    texts = {name: httpx.get(url, timeout=10).text for name, url in urls.items()}
    for name, metric in ok.items():
        assert f'{metric}{{status="ok"}} {before[name] + 1:.1f}' in texts[name], name
    assert "kvpool_node_transport_bytes_total" in texts["node-0"]
    assert "kvpool_master_objects" in texts["master"] and "kvpool_requests_total" in texts["gateway"]
    for name, text in texts.items():  # Prometheus conventions: no _created series, counters end in _total
        assert "_created" not in text, name
        for line in text.splitlines():
            if line.startswith("# TYPE ") and line.endswith(" counter"):
                assert line.split()[2].endswith("_total"), (name, line)
    assert "# TYPE kvpool_store_evictions_total counter" in texts["gateway"]
    _every_queried_metric_is_exported(texts)
    requests = [ln for ln in texts["gateway"].splitlines() if ln.startswith("kvpool_requests_total{")]
    assert requests and all('tenant="none"' in ln and 'workload="default"' in ln for ln in requests)
    capsys.readouterr()
    assert run_status(argparse.Namespace(state=None, json=True)) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["services"]}
    assert {n: r["metrics"] for n, r in rows.items()} == urls
    assert run_status(argparse.Namespace(state=None, json=False)) == 0
    assert urls["prefill-0"] in capsys.readouterr().out


def test_k8s_and_compose_expose_and_annotate_every_metrics_port() -> None:
    deploy = Path(__file__).resolve().parent.parent / "deploy"
    docs = [
        d for p in sorted((deploy / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d
    ]
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = d["spec"]["template"]
        c = pod["spec"]["containers"][0]
        notes = pod["metadata"].get("annotations", {})
        assert notes.get("prometheus.io/scrape") == "true", d["metadata"]["name"]
        port = int(notes["prometheus.io/port"])
        assert port in {p["containerPort"] for p in c["ports"]}, d["metadata"]["name"]
        # the master's args are one `sh -c` script (its shard comes from the pod ordinal): read them as text
        flag = re.search(r"--metrics-port\W+(\d+)", " ".join(c["args"]))
        if flag:
            assert int(flag.group(1)) == port
        else:
            assert c["name"] in ("gateway", "etcd")  # both serve /metrics on their API (client) port
    compose = yaml.safe_load((deploy / "docker-compose.yml").read_text())["services"]
    for name in ("node", "prefill-0", "prefill-1", "decode-0"):
        cmd = compose[name]["command"]
        assert cmd[cmd.index("--metrics-port") + 1] in compose[name]["expose"], name


def _queried() -> tuple[set[str], set[str], set[str]]:
    """(kvpool series the rules and the dashboard query, recording rules defined, recorded names queried)."""
    deploy = Path(__file__).resolve().parent.parent / "deploy"
    rules = yaml.safe_load((deploy / "prometheus" / "rules.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    defined = {r["record"] for g in rules["groups"] for r in g["rules"]}
    dash = json.loads((deploy / "grafana" / "dashboards" / "kvpool.json").read_text())
    dash_exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    series = {m for e in exprs + dash_exprs for m in re.findall(r"(?<![:\w])kvpool_[a-z0-9_]+", e)}
    recorded = {m for e in dash_exprs for m in re.findall(r"\b[a-z_]+:kvpool_[a-z0-9_:]+", e)}
    return series, defined, recorded


def _every_queried_metric_is_exported(texts: dict[str, str]) -> None:
    exported = {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for text in texts.values()
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    series, defined, recorded = _queried()
    assert series and not series - exported, sorted(series - exported)
    assert recorded and recorded <= defined, sorted(recorded - defined)
