"""Sweeps on Ray: N nodes against one, and where the difference goes (issue #42 part 4's goal: N nodes give
>= 0.8 N x one node on a sweep of >= 2N points of >= 10 s each, measured at N = 2 on loopback for equality
and overhead, the scaling argued from measured task and transfer times).

A real local cluster: a Ray head with 1 CPU, then a second node with 1 CPU on 127.0.0.1 (each node a core of
its own on a 2-core box). The same sweep runs as Ray tasks on the one-node cluster, then on the two-node
one: the default policy (hybrid, K3) at ``--points`` capacities on the bundled conversation trace tiled to
``--requests`` requests (``bench/trace_io_bench.py``'s tiling: each copy's ids and times shifted), so that
a point takes >= 10 s. Measured beside the two sweeps, on the two-node cluster:

- ``put``: ``ray.put`` of what every task receives (the trace, the spec, the warmed chain hashes), once;
- ``first task``: a task pinned to the second node that takes that object as a sweep's task does (the
  transfer, and the unpickling ``parallel_ray`` does once per worker process);
- ``later task``: the same again (the worker's copy reused: what each further point costs beyond its work);
- a no-op task's round trip, median of 20.

The model: a sweep of P points of t seconds on N nodes of one core takes ``put + first task + ceil(P / N) x
(t + later task)``; the table prints its efficiency against one Ray node at N = 2 (beside the measured
ratio) and at larger N with P = 2N points of 10 s, and against the bare compute of one core. Then, without
Ray, the sweep in one process and in a local pool of 2: the box's own two-core efficiency.

Needs Ray (not in ``make test``'s venvs): a venv with ``ray`` that sees the project's ``.venv``, as
``scripts/ray_check.sh`` builds one::

    RAY_VENV=/tmp/rayvenv scripts/ray_check.sh        # once: builds the venv, checks the rows
    /tmp/rayvenv/bin/python bench/ray_scaling_bench.py --requests 100000 --points 4

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.trace_io_bench import tiled_mooncake

GiB = 1 << 30


class PointTimes:
    """A ``PointProgress`` stand-in that keeps each point's compute seconds, as the tasks measured them."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def begin(self) -> None:
        return

    def finished(self, label: str, capacity_bytes: int | None, seconds: float | None = None) -> None:
        if seconds is not None:
            self.seconds.append(seconds)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ray_cli(*args: str, env: dict[str, str]) -> None:
    ray = Path(sys.executable).with_name("ray")
    subprocess.run([str(ray), *args], check=True, env=env, capture_output=True, timeout=120)


def wait_cpus(ray: Any, cpus: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ray.cluster_resources().get("CPU", 0) < cpus:
        if time.monotonic() > deadline:
            raise SystemExit(f"the cluster did not reach {cpus} CPUs within {timeout_s:g} s")
        time.sleep(0.2)


def sweep(
    requests: list, capacities: list[int], address: str | None, jobs: int = 1
) -> tuple[list[dict], float, list[float]]:
    """The sweep as Ray tasks at ``address``, or (None) in a local pool of ``jobs`` processes: its rows, wall
    seconds and each point's compute seconds."""
    from kvpool.worker.checkpoint_policy import CheckpointPolicy
    from kvpool.workloads.specs import get_spec
    from kvpool.workloads.sweep import capacity_sweep

    times = PointTimes()
    t0 = time.perf_counter()
    spec, ck = get_spec("k3"), CheckpointPolicy()
    rows = capacity_sweep(
        requests, spec, capacities, "bytes", ["hybrid"], ck, points=times, jobs=jobs, ray=address
    )
    return rows, time.perf_counter() - t0, times.seconds


def overheads(ray: Any, requests: list) -> dict[str, float]:
    """On the running two-node cluster: the put of what a sweep's tasks receive, a first task on the second
    node that takes it (the transfer, and the unpickling that ``parallel_ray`` does once per worker), a
    second such task (the worker's copy reused: a task's own cost), and a no-op task's round trip."""
    from kvpool.workloads.chains import warmed_builder
    from kvpool.workloads.parallel_ray import _shared
    from kvpool.workloads.sim import effective_block_size
    from kvpool.workloads.specs import get_spec
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    spec = get_spec("k3")
    bs = effective_block_size(requests, spec, None)
    shared = (requests, spec, None, warmed_builder(requests, spec.name, bs))  # what a sweep's tasks receive
    blob_mb = len(pickle.dumps(shared, protocol=5)) / 1e6
    t0 = time.perf_counter()
    ref = ray.put(shared)
    put_s = time.perf_counter() - t0
    here = ray.get_runtime_context().get_node_id()
    other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
    on_other = NodeAffinitySchedulingStrategy(other, soft=False)

    @ray.remote(num_cpus=1)
    def takes(box: list) -> None:
        _shared(box)  # what every point's task does first

    @ray.remote(num_cpus=1)
    def noop() -> None:
        return None

    def timed(fn: Any) -> float:
        t = time.perf_counter()
        ray.get(fn())
        return time.perf_counter() - t

    first_s = timed(lambda: takes.options(scheduling_strategy=on_other).remote([ref]))
    again_s = statistics.median(timed(lambda: takes.options(scheduling_strategy=on_other).remote([ref]))
                                for _ in range(5))  # fmt: skip
    timed(noop.remote)
    task_s = statistics.median(timed(noop.remote) for _ in range(20))
    return {"put_s": put_s, "first_task_s": first_s, "later_task_s": again_s, "task_s": task_s,
            "shared_mb": blob_mb}  # fmt: skip


def model(points: int, nodes: int, point_s: float, o: dict[str, float], ray_reference: bool) -> float:
    """Efficiency of ``nodes`` one-core Ray nodes on ``points`` points of ``point_s`` seconds: against one Ray
    node (``ray_reference``: it pays the put, its own first task and every task's overhead too) or against
    the bare compute of one core. A sweep on N nodes takes ``put + first task + ceil(P / N) x (t + task)``:
    the put once, each node's first task (transfer and unpickling) in parallel, then a task's overhead per
    point."""

    def wall(n: int) -> float:
        return o["put_s"] + o["first_task_s"] + math.ceil(points / n) * (point_s + o["later_task_s"])

    reference = wall(1) if ray_reference else points * point_s
    return reference / (nodes * wall(nodes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000, help="the tiled trace's requests")
    ap.add_argument("--points", type=int, default=4, help="capacities (>= 2N = 4)")
    args = ap.parse_args()
    import ray
    from kvpool.workloads.trace import read_trace

    tmp = Path(tempfile.mkdtemp(prefix="ray-scaling-"))
    trace = tmp / "trace.jsonl"
    tiled_mooncake(trace, args.requests)
    requests = read_trace(trace)
    capacities = [int((29 + 30 * i) * GiB) for i in range(args.points)]
    env = {**os.environ, "RAY_TMPDIR": str(tmp / "ray"), "RAY_USAGE_STATS_ENABLED": "0"}
    (tmp / "ray").mkdir()
    port = free_port()
    address = f"127.0.0.1:{port}"
    os.environ.update(env)
    try:
        ray_cli("start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "1",
                "--include-dashboard", "false", "--temp-dir", str(tmp / "ray"), "--disable-usage-stats",
                env=env)  # fmt: skip
        ray.init(address=address, log_to_driver=False, include_dashboard=False)  # connected before the clock
        rows1, wall1, took1 = sweep(requests, capacities, address)
        ray_cli("start", "--address", address, "--node-ip-address", "127.0.0.1", "--num-cpus", "1", env=env)
        wait_cpus(ray, 2)
        rows2, wall2, took2 = sweep(requests, capacities, address)
        o = overheads(ray, requests)
        ray.shutdown()
        ray_cli("stop", "--force", env=env)
        # the box's own two-core parallelism, without Ray: the sweep in one process, then in a pool of 2
        rows_l1, wall_l1, _ = sweep(requests, capacities, None, jobs=1)
        rows_l2, wall_l2, _ = sweep(requests, capacities, None, jobs=2)
    finally:
        subprocess.run([str(Path(sys.executable).with_name("ray")), "stop", "--force"], env=env,
                       capture_output=True, timeout=120)  # fmt: skip
    point_s = statistics.mean(took1 + took2)
    measured = wall1 / (2 * wall2)
    local = wall_l1 / (2 * wall_l2)
    table = [
        ("points x compute s, 1 node (mean)", f"{args.points} x {statistics.mean(took1):.2f}"),
        ("points x compute s, 2 nodes (mean)", f"{args.points} x {statistics.mean(took2):.2f}"),
        ("Ray, 1 node: sweep wall s", f"{wall1:.2f}"),
        ("Ray, 2 nodes: sweep wall s", f"{wall2:.2f}"),
        ("local, 1 process / pool of 2: sweep wall s", f"{wall_l1:.2f} / {wall_l2:.2f}"),
        ("efficiency, Ray: 1 node / (2 x 2 nodes)", f"{measured:.3f}"),
        ("efficiency, local: 1 process / (2 x pool of 2)", f"{local:.3f}"),
        ("put of the shared data s", f"{o['put_s']:.3f}"),
        ("shared data MB (pickled)", f"{o['shared_mb']:.1f}"),
        ("first task on the second node s", f"{o['first_task_s']:.3f}"),
        ("a later task there s", f"{o['later_task_s']:.4f}"),
        ("no-op task round trip s", f"{o['task_s']:.4f}"),
        ("model at N = 2 (these points), vs 1 Ray node", f"{model(args.points, 2, point_s, o, True):.3f}"),
    ]
    for n in (2, 4, 8, 16, 64):
        table.append((f"model at N = {n}, {2 * n} points of 10 s, vs 1 Ray node",
                      f"{model(2 * n, n, 10.0, o, True):.3f}"))  # fmt: skip
    table.append(("model, 2N points of 10 s, vs bare compute", f"{model(4, 2, 10.0, o, False):.3f}"))
    for k, v in table:
        print(f"{k:<52} {v:>16}")
    print(json.dumps({
        "bench": "ray_scaling", "ray": ray.__version__, "requests": args.requests, "points": args.points,
        "rows_equal": rows1 == rows2 == rows_l1 == rows_l2, "point_s": round(point_s, 3),
        "point_s_1_node": round(statistics.mean(took1), 3),
        "point_s_2_nodes": round(statistics.mean(took2), 3),
        "wall_1_node_s": round(wall1, 2), "wall_2_nodes_s": round(wall2, 2),
        "wall_local_1_s": round(wall_l1, 2), "wall_local_2_s": round(wall_l2, 2),
        "efficiency_2_measured": round(measured, 3), "efficiency_local_2": round(local, 3),
        "overheads": {k: round(v, 4) for k, v in o.items()},
        "model_vs_1_ray_node": {str(n): round(model(2 * n, n, 10.0, o, True), 3) for n in (2, 4, 8, 16, 64)},
        "model_vs_bare_compute": round(model(4, 2, 10.0, o, False), 3),
        "goal_ge_0.8": measured >= 0.8,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
