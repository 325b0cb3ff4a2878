"""``kvpool status``: every service of the cluster ``kvpool up`` started, its pid, address, health and metrics
endpoint, read from the run's ``state.json``; exit 0 only when every service answers its health check."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvpool.launch.config import runs_root
from kvpool.runtime.spawn import pid_alive


def register(subparsers: argparse._SubParsersAction) -> None:
    st = subparsers.add_parser("status", help="show the cluster started by `kvpool up`")
    st.add_argument("--state", type=Path, default=None, help="state.json (default: the current run)")
    st.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    st.set_defaults(func=run_status)


def _grpc_serving(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.UNIMPLEMENTED  # up, but without a health service
        return r.status == health_pb2.HealthCheckResponse.SERVING


def _master_answers(address: str, key: bytes | None) -> bool:
    """A master serves no gRPC: it is up when it answers ``Describe`` on its wire (a standby does too)."""
    from kvpool.kvstore.errors import StoreError
    from kvpool.kvstore.protocol.master_wire import call_blocking
    from kvpool.proto import master_pb2

    try:
        call_blocking(address, "Describe", master_pb2.DescribeRequest(), 1.0, key=key)
    except StoreError:
        return False
    return True


def service_health(svc: dict, key: bytes | None = None) -> str:
    """``down`` (no process), ``up`` (answers its health check), ``unhealthy``; ``key`` is the run's cluster
    secret (the master's wire wants its hello)."""
    if not pid_alive(int(svc["pid"])):
        return "down"
    if svc["role"] == "gateway":
        import httpx

        try:
            r = httpx.get(f"{svc['ready']['url']}/health", timeout=2.0)
        except httpx.HTTPError:
            return "unhealthy"
        return "up" if r.status_code == 200 else "degraded"
    if svc["role"] == "master":
        return "up" if _master_answers(svc["address"], key) else "unhealthy"
    return "up" if _grpc_serving(svc["address"]) else "unhealthy"


def run_status(args: argparse.Namespace) -> int:
    path = args.state or runs_root() / "current.json"
    try:
        state = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        print(f"kvpool status: no running cluster ({path} not found)", file=sys.stderr)
        return 1
    from kvpool.runtime.cluster_auth import read_secret_file

    key = read_secret_file(state["secret_file"]) if state.get("secret_file") else None
    rows = [
        {
            "name": s["name"],
            "role": s["role"],
            "pid": s["pid"],
            "address": s["address"],
            "metrics": s.get("metrics"),
            "health": service_health(s, key),
            "netns": s.get("netns"),
            "log": s["log"],
            **({"shard": s["ready"]["shard"]["index"]} if s.get("ready", {}).get("shard") else {}),
        }
        for s in state["services"]
    ]
    shards: dict[int, list[dict]] = {}  # master shards (one, unsharded): their masters
    for r in rows:
        if r["role"] == "master":
            shards.setdefault(r.get("shard", 0), []).append(r)
    summary = []
    for shard, masters in sorted(shards.items()):
        leader = masters[0]["address"] if masters[0]["health"] == "up" else None
        if len(masters) > 1:  # an HA group: say which one leads
            from kvpool.launch.ha_cluster import leader_of

            leader = leader_of([r["address"] for r in masters if r["health"] == "up"], key=key)
            for r in masters:
                r["leader"] = r["address"] == leader
        summary.append({"shard": shard, "masters": [r["address"] for r in masters], "leader": leader})
    if args.json:
        print(
            json.dumps(
                {
                    "run_dir": state["run_dir"],
                    "gateway_url": state["gateway_url"],
                    "services": rows,
                    "shards": summary,
                }
            )
        )
    else:
        print(f"run dir {state['run_dir']}   gateway {state['gateway_url']}   routing {state.get('routing')}")
        for r in rows:
            print(
                f"  {r['name']:<10} {r['role']:<8} pid {r['pid']:<8} {r['address']:<22} {r['health']:<10} "
                f"{r['metrics'] or '-'}"
                + (f"  netns {r['netns']}" if r["netns"] else "")
                + ({True: "  leader", False: "  standby"}.get(r.get("leader"), ""))
                + (f"  shard {r['shard']}" if "shard" in r else "")
            )
        if len(summary) > 1:
            for s in summary:
                print(f"  shard {s['shard']}: leader {s['leader'] or 'none (its chains miss)'}")
    return 0 if all(r["health"] == "up" for r in rows) else 3
