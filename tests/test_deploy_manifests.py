"""deploy/: Kubernetes manifests against the official OpenAPI schemas (kubernetes-validate, offline, strict),
docker-compose.yml (alone and with the docker-compose.shards.yml override) and the Dockerfile structurally,
and every container command against kvpool's own CLI parser — so a renamed flag breaks this test instead of
a deployment; the master shard settings (KVPOOL_SHARDS, the pod ordinal's shard, the ';' master address) for
agreement. No docker daemon or cluster needed."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kvpool.kvstore.master.core import MasterConfig
from kvpool.kvstore.shards import ShardSet, master_groups

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


def parse_cli(argv: list[str]) -> argparse.Namespace:
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on a bad flag
        raise AssertionError(f"kvpool rejects {argv}") from exc


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of command and args: a defined $(NAME) is replaced, an undefined one
    (or anything else in $(...), such as a shell's $((a / 2))) is left as written, $$ is a literal $."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            if text[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            if text[i + 1] == "(" and (end := text.find(")", i + 2)) >= 0:
                name = text[i + 2 : end]
                out.append(env.get(name, f"$({name})"))
                i = end + 1
                continue
        out.append(text[i])
        i += 1
    return "".join(out)


def container_argv(container: dict, env: dict[str, str]) -> list[str]:
    """The kvpool argv a container runs: its args expanded as the kubelet does; a `sh -c` script is run by
    a real sh with its environment and a stub `kvpool` on PATH that prints the argv it was exec'd with."""
    args = [k8s_expand(a, env) for a in container["args"]]
    if container.get("command") is None:
        return args
    assert container["command"] == ["sh", "-c"] and len(args) == 1, container["name"]
    assert re.search(r"^\s*exec kvpool ", args[0], re.M), "kvpool must replace sh (signals reach it)"
    with tempfile.TemporaryDirectory() as stub:
        kvpool = Path(stub) / "kvpool"
        kvpool.write_text("#!/bin/sh\nprintf '%s\\0' \"$@\"\n")
        kvpool.chmod(0o755)
        run_env = dict(env, PATH=f"{stub}{os.pathsep}/usr/bin{os.pathsep}/bin")
        r = subprocess.run(["sh", "-c", args[0]], env=run_env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("\0")[:-1]


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


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
            argv = container_argv(c, env)
            assert "$(" not in " ".join(argv), argv  # every $(VAR) is one the ConfigMap or the pod defines
            parse_cli(argv)
            if "--port" in argv:
                assert int(argv[argv.index("--port") + 1]) in ports, c["name"]


def k8s_master_address(shards: int) -> str:
    """KVPOOL_MASTER for `shards` HA pairs: shard I is pods 2I and 2I+1, shards separated by ';'."""
    return ";".join(
        ",".join(f"kvpool-master-{2 * i + j}.kvpool-master:50051" for j in (0, 1)) for i in range(shards)
    )


def test_k8s_configmap_sets_the_shard_count_and_depth() -> None:
    docs = k8s_docs()
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    # the default is today's fleet: one shard (one HA pair), depth 2
    assert config["KVPOOL_SHARDS"] == "1" and config["KVPOOL_SHARD_DEPTH"] == "2"
    shards = ShardSet(int(config["KVPOOL_SHARDS"]), int(config["KVPOOL_SHARD_DEPTH"]))
    assert shards == ShardSet()
    assert config["KVPOOL_MASTER"] == k8s_master_address(shards.count)
    assert len(master_groups(config["KVPOOL_MASTER"])) == shards.count
    master = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "kvpool-master")
    assert master["spec"]["replicas"] == 2 * shards.count
    # the comment's 2-shard example is the address the masters' ordinals give
    text = (DEPLOY / "k8s" / "configmap.yaml").read_text()
    assert f'KVPOOL_MASTER: "{k8s_master_address(2)}"' in text
    clients = STATELESS | {"kvpool-node"}
    for d in docs:  # every client holds the master list and the fleet's depth
        if d["kind"] not in ("Deployment", "StatefulSet") or d["metadata"]["name"] not in clients:
            continue
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        assert flag(args, "--master") == "$(KVPOOL_MASTER)", d["metadata"]["name"]
        assert flag(args, "--shard-depth") == "$(KVPOOL_SHARD_DEPTH)", d["metadata"]["name"]


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_k8s_master_pod_ordinal_chooses_its_shard(shards: int) -> None:
    docs = k8s_docs()
    config = dict(next(d for d in docs if d["kind"] == "ConfigMap")["data"])
    config.update(KVPOOL_SHARDS=str(shards), KVPOOL_MASTER=k8s_master_address(shards))
    sts = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "kvpool-master")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    groups = master_groups(config["KVPOOL_MASTER"])
    for ordinal in range(2 * shards + 1):
        argv = container_argv(container, dict(config, POD_NAME=f"kvpool-master-{ordinal}"))
        args = parse_cli(argv)
        assert argv[:2] == ["store", "master"] and args.etcd == config["KVPOOL_ETCD"]
        assert (args.shards, args.shard, args.shard_depth) == (shards, ordinal // 2, 2), argv
        assert args.ha_group == "kvpool" and args.port == 50051
        config_ok = MasterConfig(shards=ShardSet(args.shards, args.shard_depth), shard=args.shard)
        if ordinal == 2 * shards:  # one replica too many: its shard is out of range and the master refuses
            with pytest.raises(ValueError, match="is not one of"):
                config_ok.validate()
            continue
        config_ok.validate()
        assert args.advertise in groups[ordinal // 2].split(","), (args.advertise, groups)
    # an older ConfigMap without the shard settings still runs one shard at depth 2
    old = {k: v for k, v in config.items() if not k.startswith("KVPOOL_SHARD")}
    args = parse_cli(container_argv(container, dict(old, POD_NAME="kvpool-master-1")))
    assert (args.shards, args.shard, args.shard_depth) == (1, 0, 2)
    # the probes still ask this pod's own master wire
    probe = ["python", "/app/deploy/healthcheck.py", "master", "127.0.0.1:50051"]
    for kind in ("readinessProbe", "livenessProbe"):
        assert container[kind]["exec"]["command"] == probe, kind


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


def compose_merge(base: dict, override: dict) -> dict:
    """`docker compose -f base -f override`'s merge, as far as these files use it: mappings merge key by key,
    `command` (like any scalar) is replaced, other sequences are appended (without repeats)."""
    merged = dict(base)
    for key, value in override.items():
        old = merged.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            merged[key] = compose_merge(old, value)
        elif isinstance(old, list) and isinstance(value, list) and key != "command":
            merged[key] = old + [v for v in value if v not in old]
        else:
            merged[key] = value
    return merged


def test_compose_shards_override_runs_two_shards() -> None:
    base_text = (DEPLOY / "docker-compose.yml").read_text()
    base = yaml.safe_load(base_text)
    override = yaml.safe_load((DEPLOY / "docker-compose.shards.yml").read_text())
    assert "-f deploy/docker-compose.yml -f deploy/docker-compose.shards.yml up" in base_text
    assert set(override) <= {"services"} | {k for k in override if k.startswith("x-")}
    assert set(override["services"]) - set(base["services"]) == {"master-2", "master-3"}
    services = compose_merge(base, override)["services"]
    masters, clients = {}, {}
    for name, svc in services.items():
        if svc.get("image") != "kvpool:0.1.0":
            continue
        argv = svc["command"]
        assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), name
        (masters if argv[:2] == ["store", "master"] else clients)[name] = parse_cli(argv)
        for dep in svc.get("depends_on", {}):
            assert dep in services, (name, dep)
    # the masters: two HA pairs, one per shard, each campaigning in its shard's etcd group
    assert set(masters) == {"master-0", "master-1", "master-2", "master-3"}
    shard_of = {}
    for name, args in masters.items():
        assert (args.shards, args.shard_depth, args.ha_group) == (2, 2, "kvpool"), name
        assert args.advertise == f"{name}:{args.port}" and args.etcd == "etcd:2379"
        MasterConfig(shards=ShardSet(args.shards, args.shard_depth), shard=args.shard).validate()
        shard_of[args.advertise] = args.shard
    assert sorted(shard_of.values()) == [0, 0, 1, 1]
    # the added masters are the base file's masters but for their command (no host port: master-0 has 9100)
    for name in ("master-2", "master-3"):
        for key in ("image", "restart", "environment", "secrets", "healthcheck", "expose", "depends_on"):
            assert services[name][key] == services["master-1"][key], (name, key)
        assert not services[name].get("ports")
    # every client: the same ';' address, shard I's group = exactly the masters serving shard I; same depth
    addresses = {args.master for args in clients.values()}
    assert set(clients) == {"node", "prefill-0", "prefill-1", "decode-0", "gateway"} and len(addresses) == 1
    groups = master_groups(addresses.pop())
    assert len(groups) == 2
    for shard, group in enumerate(groups):
        assert {a for a, s in shard_of.items() if s == shard} == set(group.split(",")), (shard, group)
    assert {args.shard_depth for args in clients.values()} == {2}
    node_deps = services["node"]["depends_on"]
    assert all(node_deps[m] == {"condition": "service_healthy"} for m in masters)
    # the base file alone is unchanged: one shard, every client one HA pair
    for name, svc in base["services"].items():
        if svc.get("image") != "kvpool:0.1.0":
            continue
        args = parse_cli(svc["command"])
        if svc["command"][:2] == ["store", "master"]:
            assert (args.shards, args.shard, args.shard_depth) == (1, 0, 2), name
        else:
            assert master_groups(args.master) == ["master-0:50051,master-1:50051"], name


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
