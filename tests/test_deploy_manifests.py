"""deploy/: Kubernetes manifests against the official OpenAPI schemas (kubernetes-validate, offline, strict),
docker-compose.yml and the Dockerfile structurally, and every container command against kvpool's own CLI
parser — so a renamed flag breaks this test instead of a deployment. No docker daemon or cluster needed."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvpool.commands.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.37.0"
STATELESS = {"kvpool-prefill", "kvpool-decode", "kvpool-gateway"}
STATEFUL = {"kvpool-node", "kvpool-master", "kvpool-etcd"}  # stable names: node ids, HA masters, etcd members


def k8s_docs() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def parse_cli(argv: list[str]) -> None:
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on a bad flag
        raise AssertionError(f"kvpool rejects {argv}") from exc


@pytest.mark.parametrize("doc", k8s_docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_k8s_manifest_is_valid_against_the_api_schema(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_k8s_layout_probes_services_and_commands() -> None:
    docs = k8s_docs()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {n for k, n in kinds if k == "Deployment"} == STATELESS
    assert {n for k, n in kinds if k == "StatefulSet"} == STATEFUL
    assert ("Secret", "kvpool-cluster-secret") in kinds
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    services = [d for d in docs if d["kind"] == "Service"]
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = d["spec"]["template"]
        assert d["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert any(s["spec"]["selector"].items() <= pod["metadata"]["labels"].items() for s in services), d
        if d["kind"] == "StatefulSet":
            assert any(s["metadata"]["name"] == d["spec"]["serviceName"] for s in services)
        for c in pod["spec"]["containers"]:
            assert "readinessProbe" in c and "livenessProbe" in c, c["name"]
            ports = {p["containerPort"] for p in c["ports"]} | {p["name"] for p in c["ports"]}
            for probe in (c["readinessProbe"], c["livenessProbe"]):
                if "exec" in probe:  # the master: its wire's Describe through deploy/healthcheck.py
                    command = probe["exec"]["command"]
                    assert command[1:3] == ["/app/deploy/healthcheck.py", "master"], command
                    port = int(command[3].rsplit(":", 1)[1])
                else:
                    port = (probe.get("grpc") or probe.get("httpGet") or probe.get("tcpSocket"))["port"]
                assert port in ports, (c["name"], port)
            assert all(r["configMapRef"]["name"] == "kvpool-config" for r in c.get("envFrom", []))
            if c["image"] != "kvpool:0.1.0":  # etcd: its own image and flags
                continue
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            assert config["KVPOOL_CLUSTER_SECRET_FILE"].rsplit("/", 1)[0] in mounts, c["name"]
            env = dict(config, POD_NAME=f"{d['metadata']['name']}-0")
            argv = [re.sub(r"\$\((\w+)\)", lambda m, env=env: env[m.group(1)], a) for a in c["args"]]
            parse_cli(argv)
            if "--port" in argv:
                assert int(argv[argv.index("--port") + 1]) in ports, c["name"]


def test_gateway_discovers_workers_through_headless_services() -> None:
    docs = k8s_docs()
    gw = next(d for d in docs if d["metadata"]["name"] == "kvpool-gateway" and d["kind"] == "Deployment")
    args = gw["spec"]["template"]["spec"]["containers"][0]["args"]
    headless = {
        d["metadata"]["name"]: d
        for d in docs
        if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None"
    }
    for flag in ("--prefill", "--decode"):
        spec = args[args.index(flag) + 1]
        _, host, port = spec.split(":")
        assert host in headless and int(port) in {p["port"] for p in headless[host]["spec"]["ports"]}


def test_compose_file_structure_and_commands() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"etcd", "master-0", "master-1", "node", "prefill-0", "prefill-1", "decode-0", "gateway"} <= set(
        services
    )
    assert compose["secrets"]["kvpool_cluster_secret"]["file"] == "./cluster.secret"
    ports_of = {}
    observability = {"prometheus", "grafana", "etcd"}
    assert observability <= set(services)
    for name in observability:  # every file they mount is in the repo
        for volume in services[name].get("volumes", []):
            assert (DEPLOY / volume.split(":")[0]).exists(), (name, volume)
    for name, svc in services.items():
        if name in observability:
            continue
        assert svc["image"] == "kvpool:0.1.0"
        assert svc["healthcheck"]["test"][0] == "CMD" and isinstance(svc["command"], list)
        parse_cli(svc["command"])
        for dep in svc.get("depends_on", {}):
            assert dep in services, (name, dep)
        cmd = svc["command"]
        if "--port" in cmd:
            ports_of[name] = int(cmd[cmd.index("--port") + 1])
    gw = services["gateway"]["command"]
    for i, arg in enumerate(gw):
        if arg in ("--prefill", "--decode", "--master"):
            for address in gw[i + 1].split(","):
                host, port = address.split(":")
                assert ports_of[host] == int(port), (arg, gw[i + 1])
                assert host in services["gateway"]["depends_on"] or arg == "--master"
    assert (ROOT / services["gateway"]["healthcheck"]["test"][2].removeprefix("/app/")).exists()


def test_dockerfile_installs_cpu_torch_and_every_package() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE=python:3\.1[1-9]", text, re.M)
    assert re.search(r"^FROM \$\{BASE\}$", text, re.M)
    assert "torch==2.13.0+cpu" in text and "download.pytorch.org/whl/cpu" in text
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for src in set(pyproject["tool"]["setuptools"]["package-dir"].values()):
        assert re.search(rf"^COPY {src}/ {src}/$", text, re.M), f"Dockerfile does not copy {src}/"
    assert re.search(r'^ENTRYPOINT \["kvpool"\]', text, re.M)
    assert re.search(r"^USER \d+", text, re.M)
    assert "deploy/healthcheck.py" in text and (DEPLOY / "healthcheck.py").exists()


def test_healthcheck_script_fails_fast_on_a_dead_port() -> None:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(DEPLOY / "healthcheck.py"), "grpc", "127.0.0.1:1"], timeout=30)
    assert r.returncode == 1 and time.monotonic() - t0 < 15
    r = subprocess.run(
        [sys.executable, str(DEPLOY / "healthcheck.py"), "http", "http://127.0.0.1:1/health"], timeout=30
    )
    assert r.returncode == 1
    r = subprocess.run([sys.executable, str(DEPLOY / "healthcheck.py"), "master", "127.0.0.1:1"], timeout=30)
    assert r.returncode == 1
    assert subprocess.run([sys.executable, str(DEPLOY / "healthcheck.py")], timeout=30).returncode == 2


def test_healthcheck_script_passes_a_live_master(tmp_path: Path) -> None:
    from tests.harness.master_proc import MasterProcess

    master = MasterProcess(tmp_path)
    try:
        r = subprocess.run(
            [sys.executable, str(DEPLOY / "healthcheck.py"), "master", master.address], timeout=30
        )
        assert r.returncode == 0
    finally:
        master.terminate()


def test_local_config_is_what_kvpool_up_reads() -> None:
    from kvpool.launch.config import DEFAULT_CONFIG, load_config

    assert DEFAULT_CONFIG == DEPLOY / "local.toml"
    cfg = load_config(overrides={"prefill": {"count": 3}})
    assert cfg["prefill"]["count"] == 3 and cfg["gateway"]["routing"] in ("cache", "rr")
    assert {"cluster", "master", "store", "prefill", "decode", "gateway"} <= set(cfg)
