"""``Cluster``: the one way kvpool starts a cluster of its services as child processes, used by ``kvpool up``,
``kvpool verify`` (its local cluster), ``make demo``, the tests and the benchmarks.

``Cluster`` starts, in order, the store master, the storage node(s), the prefill and decode workers (all
workers at once: their torch imports overlap) and, unless ``gateway=False``, the gateway; every child binds
port 0 (the gateway its configured port) and announces itself with one JSON readiness line, read from its log
file under a deadline. One set of defaults, ``deploy/local.toml`` (``kvpool.launch.config``): a caller that
needs something else (one prefill, fast heartbeats, a tcp-only data plane) passes it as config overrides.
Each service logs to ``<run dir>/<name>.log``. ``stop`` (also on Ctrl-C / SIGTERM) terminates the gateway,
then the workers, then the store, SIGKILLs what does not exit in time and unlinks any storage-node shared
memory segment left behind. ``state.json`` in the run dir (with ``publish``, also copied to
``<runs root>/current.json``) records pids, ports and logs for ``kvpool status`` and ``kvpool chaos``.

Why children get their own session: Ctrl-C in a terminal signals the whole foreground process group; the
launcher, not the terminal, must decide the shutdown order (workers flush pushes before the store goes).
Because they no longer share its fate through the terminal, each child also asks the kernel for SIGTERM
when the launcher dies (Linux ``PR_SET_PDEATHSIG``): a ``kill -9`` of the launcher leaves no orphans.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.kvstore.shards import ShardSet
from kvpool.launch import ha_cluster
from kvpool.launch.config import load_config, runs_root
from kvpool.launch.placement import LoopbackPlacement, NetnsPlacement, Placed, make_placement
from kvpool.launch.service_argv import gateway_argv, master_argv, node_argv, worker_argv
from kvpool.runtime import cluster_auth
from kvpool.runtime.spawn import Child, LaunchError, wait_ready
from kvpool.runtime.spawn import start as spawn_start

STOP_TIMEOUT_S = 10.0


def _master_name(shard: int, i: int, sharded: bool, ha: bool) -> str:
    """``master`` alone; ``master-I`` of an HA group; ``master-sS`` / ``master-sS-I`` with shards."""
    base = f"master-s{shard}" if sharded else "master"
    return f"{base}-{i}" if ha else base


def _metrics_args(section: dict, i: int) -> list[str]:
    """``--metrics-port`` of instance ``i`` when the section sets ``metrics_port`` >= 0: 0 = any free port,
    a fixed port P gives instance i port P + i; absent, empty or negative = off."""
    port = section.get("metrics_port")
    if port is None or port == "" or int(port) < 0:
        return []
    return ["--metrics-port", str(int(port) + i if int(port) else 0)]


@dataclass
class ServiceProcess(Child):
    """The process of one service of the cluster: a spawned child (``kvpool.runtime.spawn``) with its role,
    and what ``Cluster.restart`` needs to start it again (its argv and where it was placed)."""

    role: str = ""
    netns: str | None = None
    argv: list[str] = field(default_factory=list)
    placed: Placed = field(default_factory=Placed)

    @property
    def port(self) -> int:
        return int(self.ready.get("port") or self.ready.get("grpc_port") or 0)

    @property
    def address(self) -> str:
        return f"{self.ready.get('host', '127.0.0.1')}:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        """Prometheus endpoint: the gateway's ``/metrics``, or ``metrics_port`` of the readiness line."""
        if self.role == "gateway":
            return f"{self.ready['url']}/metrics" if self.ready.get("url") else None
        port = self.ready.get("metrics_port")
        return f"http://{self.ready.get('host', '127.0.0.1')}:{port}/metrics" if port else None

    def describe(self) -> dict:
        return {
            "name": self.name,
            "role": self.role,
            "pid": self.popen.pid,
            "address": self.address,
            "netns": self.netns,
            "ip": self.ready.get("host", "127.0.0.1"),
            "metrics": self.metrics_url,
            "log": str(self.log_path),
            "ready": self.ready,
        }


class Cluster:
    """Context manager: ``with Cluster(load_config()) as c: openai.OpenAI(base_url=c.base_url + "/v1")``.

    Call ``start`` from a thread that outlives the cluster (the main thread, normally): the kernel ties the
    children's death signal to the thread that spawned them.

    ``gateway=False`` stops at the workers (callers that drive prefill and decode over gRPC themselves).
    ``auth=False`` runs without a cluster secret, for callers that talk to the workers or the store from
    their own process and hold no secret (tests, ``kvpool verify``, benchmarks). ``publish=False`` leaves
    ``<runs root>/current.json`` alone, so a ``kvpool up`` already running stays the one ``kvpool status``
    shows. ``netns``/``link``: every service in its own network namespace (``placement``); ``ha``: two
    masters elected through ``etcd_members`` etcd members (``ha_cluster``). ``shards``: that many master
    shards (``[master] shards`` otherwise), each one master or, with ``ha``, its own HA group of two; every
    client is given them all as ``G0;G1;...`` (docs/design/sharding.md).
    """

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        run_dir: Path | None = None,
        *,
        netns: bool = False,
        link: str | None = None,
        ha: bool = False,
        etcd_members: int = 1,
        gateway: bool = True,
        auth: bool = True,
        publish: bool = True,
        shards: int | None = None,
    ) -> None:
        self.config = config or load_config()
        m = self.config.get("master", {})
        self.shards = ShardSet(
            int(m.get("shards", 1)) if shards is None else shards, int(m.get("shard_depth", 2))
        )
        self.run_dir = run_dir or runs_root() / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.services: dict[str, ServiceProcess] = {}
        self.fingerprint: str | None = None
        self._netns, self._link = netns, link
        self._ha, self._etcd_members = ha, etcd_members
        self._gateway, self._auth, self._publish = gateway, auth, publish
        self.master_address = ""  # what every client is given: one address, or the HA group's list
        self.secret_file: Path | None = None  # this run's cluster secret (every internal listener needs it)
        self.placement: LoopbackPlacement | NetnsPlacement = LoopbackPlacement()

    # -- processes ---------------------------------------------------------------------------------------
    def start_service(
        self, name: str, role: str, argv: list[str], *, isolated: bool = False, placed: Placed | None = None
    ) -> ServiceProcess:
        """Start one service (``python -m ARGV``) as this cluster's child and return at once (wait for it with
        ``kvpool.runtime.spawn.wait_ready``); ``isolated`` services get their own namespace under
        ``--netns`` (and bind its IP), the others (the gateway, test helpers) stay in the launcher's."""
        log_path = self.run_dir / f"{name}.log"
        if placed is None:
            placed = self.placement.place(name) if isolated else Placed()
        full_argv = [*argv, "--host", placed.host] if placed.netns else list(argv)
        env = {cluster_auth.ENV_FILE: str(self.secret_file)} if self.secret_file else None
        svc = spawn_start(
            name, full_argv, log_path, own_session=True, child_type=ServiceProcess, role=role,
            prefix=placed.prefix, netns=placed.netns, env=env, argv=list(argv), placed=placed,
        )  # fmt: skip
        self.services[name] = svc
        return svc

    def restart(self, name: str) -> ServiceProcess:
        """Start service ``name`` again, same flags and place, once it has exited or been killed (a test's
        storage node after a fault); waits for its readiness line. The old process's shared memory segment,
        if any, is unlinked: nobody can attach to a dead node's pool again."""
        old = self.services[name]
        old.kill()
        self._unlink_shm(old)
        svc = self.start_service(name, old.role, old.argv, placed=old.placed)
        wait_ready(svc, float(self.config["cluster"].get("ready_timeout_s", 90)))
        self.write_state()
        return svc

    def start(self) -> Cluster:
        c = self.config
        cl, m, st, pf, dc = c["cluster"], c["master"], c["store"], c["prefill"], c["decode"]
        timeout = float(cl.get("ready_timeout_s", 90))
        try:
            self.secret_file = self._write_secret() if self._auth else None
            self.placement = make_placement(self.run_dir, self._netns, self._link)
            ha_flags: list[str] = []
            if self._ha:
                # etcd members get their namespaces first: each one's peers must be named at its start
                hosts = [self.placement.place(f"etcd-{i}") for i in range(self._etcd_members)]
                etcd = ha_cluster.start_etcd(
                    lambda name, role, argv, i: self.start_service(name, role, argv, placed=hosts[i]),
                    wait_ready,
                    self.run_dir,
                    [h.host for h in hosts],
                    timeout,
                )
                ha_flags = ha_cluster.master_flags(etcd)
            per_group = ha_cluster.MASTERS if self._ha else 1
            groups = [  # one group of masters per shard: all start at once
                [
                    self.start_service(
                        _master_name(shard, i, self.shards.sharded, self._ha),
                        "master",
                        [*self._master_argv(m, shard * per_group + i), *self._shard_flags(shard), *ha_flags],
                        isolated=True,
                    )
                    for i in range(per_group)
                ]
                for shard in range(self.shards.count)
            ]
            for group in groups:
                for master in group:
                    wait_ready(master, timeout)
            if self._ha:
                key = cluster_auth.read_secret_file(str(self.secret_file)) if self.secret_file else None
                for group in groups:
                    ha_cluster.wait_for_leader([s.address for s in group], timeout, key=key)
            master = self.master_address = ";".join(",".join(s.address for s in g) for g in groups)
            nodes = [
                self.start_service(
                    f"node-{i}",
                    "node",
                    node_argv(
                        master,
                        st["capacity"],
                        st.get("transport", "tcp,shm"),
                        [*self._ssd_args(i), *_metrics_args(st, i), *self._shard_flags(None)],
                    ),
                    isolated=True,
                )
                for i in range(int(st.get("nodes", 1)))
            ]
            workers = [
                *self._spawn_workers(
                    "prefill",
                    master,
                    pf,
                    ["--checkpoint-policy", pf.get("checkpoint_policy", "end,junction")],
                ),
                *self._spawn_workers("decode", master, dc, ["--max-batch", str(dc.get("max_batch", 64))]),
            ]
            for svc in [*nodes, *workers]:
                wait_ready(svc, timeout)
            self.fingerprint = workers[0].ready.get("fingerprint")
            if self._gateway:
                argv = gateway_argv(
                    self.config, master, [(w.role, w.address) for w in workers], self.fingerprint
                )
                argv += self._shard_flags(None)
                wait_ready(self.start_service("gateway", "gateway", argv), timeout)
                self._wait_healthy(timeout)
            self.write_state()
        except BaseException:
            self.stop()
            raise
        return self

    def _write_secret(self) -> Path:
        """A fresh cluster secret for this run, readable by this user only."""
        path = self.run_dir / "cluster.secret"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(cluster_auth.new_secret())
        return path

    def _master_argv(self, m: dict, i: int) -> list[str]:
        """Master ``i``'s flags; fixed ports in the config give master i port P + i."""
        port, metrics = int(m.get("port", 0)), int(m.get("metrics_port", -1))
        return master_argv(
            port=port + i if port else 0,
            metrics_port=metrics + i if metrics > 0 else metrics,
            policy=m.get("policy", "hybrid"),
            heartbeat_ms=int(m.get("heartbeat_ms", 500)),
            node_timeout_ms=int(m.get("node_timeout_ms", 3000)),
            extra=[
                *("--max-objects", str(int(m.get("max_objects", 0)))),
                *("--pin-share", str(float(m.get("pin_share", 0.5)))),
                *("--pin-budget-step", str(float(m.get("pin_budget_step", 0.02)))),
            ],
        )

    def _shard_flags(self, shard: int | None) -> list[str]:
        """Master shard ``shard``'s flags (``None``: a client's, which learns the count from ``G0;G1;...``);
        nothing without shards."""
        if not self.shards.sharded:
            return []
        depth = ["--shard-depth", str(self.shards.depth)]
        return depth if shard is None else ["--shards", str(self.shards.count), "--shard", str(shard), *depth]

    def _spawn_workers(
        self, role: str, master: str, section: dict, role_flags: list[str]
    ) -> list[ServiceProcess]:
        """Start ``section["count"]`` workers of ``role``; all start at once (their torch imports overlap)."""
        cl = self.config["cluster"]
        return [
            self.start_service(
                f"{role}-{i}",
                role,
                worker_argv(
                    role,
                    master,
                    model=cl["model"],
                    block_size=int(cl["block_size"]),
                    threads=int(cl.get("threads", 1)),
                    transport=section.get("transport", "auto"),
                    extra=[
                        *role_flags,
                        *_metrics_args(section, i),
                        *self._shard_flags(None),
                        *section.get("args", []),
                    ],
                ),
                isolated=True,
            )
            for i in range(int(section.get("count", 1)))
        ]

    def _ssd_args(self, i: int) -> list[str]:
        """SSD tier of node ``i`` under the run dir when ``[store] ssd_capacity`` is set (removed at stop)."""
        capacity = self.config["store"].get("ssd_capacity")
        if not capacity:
            return []
        return ["--ssd-path", str(self.run_dir / f"ssd-{i}"), "--ssd-capacity", str(capacity)]

    def _wait_healthy(self, timeout_s: float) -> None:
        """The gateway's /health turns 200 once its health poller has seen every role serving."""
        import httpx

        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{self.base_url}/health", timeout=2.0)
                if r.status_code == 200:
                    return
                last = r.text
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.1)
        raise LaunchError(f"gateway not healthy within {timeout_s:.0f}s: {last}")

    @property
    def base_url(self) -> str:
        return self.services["gateway"].ready["url"]

    def by_role(self, role: str) -> list[ServiceProcess]:
        return [s for s in self.services.values() if s.role == role]

    def address(self, name: str) -> str:
        """``host:port`` of service ``name`` (``master``, ``node-0``, ``prefill-0``, ``decode-0``...)."""
        return self.services[name].address

    # -- state ------------------------------------------------------------------------------------------
    def state(self) -> dict:
        return {
            "launcher_pid": os.getpid(),
            "run_dir": str(self.run_dir),
            "started": time.time(),
            "gateway_url": self.services["gateway"].ready.get("url") if "gateway" in self.services else None,
            "routing": self.config["gateway"].get("routing"),
            "services": [s.describe() for s in self.services.values()],
            "netns": self.placement.state(),
            "master_address": self.master_address,
            "secret_file": str(self.secret_file) if self.secret_file else None,
        }

    def write_state(self) -> Path:
        path = self.run_dir / "state.json"
        data = json.dumps(self.state(), indent=2)
        for p in (path, runs_root() / "current.json") if self._publish else (path,):
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_suffix(".tmp")
            tmp.write_text(data)
            tmp.replace(p)
        return path

    # -- shutdown ---------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Gateway, then workers, then nodes, then master; SIGTERM, then SIGKILL after a deadline."""
        for roles in (("gateway",), ("prefill", "decode"), ("node",), ("master",), ("etcd",)):
            group = [s for s in self.services.values() if s.role in roles and s.alive()]
            for s in group:
                with contextlib.suppress(ProcessLookupError):
                    s.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for s in group:
                try:
                    s.popen.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    s.popen.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        s.popen.wait(5)
        for ssd in self.run_dir.glob("ssd-*"):
            shutil.rmtree(ssd, ignore_errors=True)
        self.placement.close()
        for s in self.by_role("node"):
            self._unlink_shm(s)
        current = runs_root() / "current.json"
        with contextlib.suppress(FileNotFoundError, ValueError, OSError):
            if json.loads(current.read_text()).get("run_dir") == str(self.run_dir):
                current.unlink()

    @staticmethod
    def _unlink_shm(node: ServiceProcess) -> None:
        """A storage node's shared memory pool outlives a killed node; the launcher removes it."""
        name = node.ready.get("shm_name")
        if name:
            with contextlib.suppress(FileNotFoundError, OSError):
                os.unlink(f"/dev/shm/{name.lstrip('/')}")

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
