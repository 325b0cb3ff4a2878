"""Capacity sweeps: hit rate vs cache capacity per eviction policy (with the offline optimum as the
physical limit) and per checkpoint policy (in K3 bytes), written as CSV rows and PNG plots.

Every point is an independent :func:`simulate` run (a fresh index), so rows are reproducible one by one
and run side by side in a process pool (``workloads/parallel.py``); an LRU sweep that the one-pass curve
computes exactly (``workloads/lru_curve.py``: pure MLA, evict-to-fit watermarks) takes one pass instead.
"""

from __future__ import annotations

import csv
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvpool.kvstore.index.eviction import POLICIES
from kvpool.worker.checkpoint_policy import CheckpointPolicy
from kvpool.workloads.chains import ChainBuilder, warmed_builder
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.labels import YARDSTICKS
from kvpool.workloads.lru_curve import lru_curve, refusal
from kvpool.workloads.offline import OFFLINE_POLICIES, offline_plan, run_offline
from kvpool.workloads.optimum import optimum
from kvpool.workloads.parallel import run_points
from kvpool.workloads.progress import PointProgress
from kvpool.workloads.sim import SimConfig, effective_block_size, simulate
from kvpool.workloads.specs import ModelSpec
from kvpool.workloads.trace import Request

ROW_FIELDS = (
    "spec", "policy", "checkpoints", "capacity", "capacity_unit", "capacity_bytes", "requests",
    "block_hit_rate", "token_hit_rate", "mla_token_hit_rate", "lost_token_fraction", "input_tokens",
    "cached_tokens", "output_tokens", "duration_s", "bytes_evicted", "mla_bytes_written", "kda_bytes_written",
    "checkpoints_written",
)  # fmt: skip

MARKERS = ("o", "s", "^", "D", "v", "x", "P", "*")
DASHES = ("-", "--", "-.", (0, (1, 1)), (0, (5, 1, 1, 1)))

ProgressFactory = Callable[[str], Callable[[int, int], None] | None]


def unique_blocks(requests: Sequence[Request], spec: ModelSpec, block_size: int) -> int:
    """Distinct prompt blocks of the workload: the capacity at which any policy equals an infinite cache
    (an upper end for sweeps)."""
    builder = ChainBuilder(spec.name, block_size)
    seen: set[bytes] = set()
    for r in requests:
        ch = builder.chain(r, with_output=False)
        seen.update(ch.hashes)
    return len(seen)


def auto_capacities(max_blocks: int, points: int = 8, min_blocks: int = 1) -> list[int]:
    """``points`` capacities spaced geometrically from max(max/256, min_blocks) to max (in blocks)."""
    if max_blocks <= 0:
        raise ReplayError("workload has no blocks to size a sweep on")
    if points < 2:
        raise ReplayError("a sweep needs at least 2 points")
    lo = min(float(max_blocks), max(1.0, max_blocks / 256, float(min_blocks)))
    return sorted({max(1, round(lo * (max_blocks / lo) ** (i / (points - 1)))) for i in range(points)})


def sweep_range(requests: Sequence[Request], spec: ModelSpec, block_size: int) -> tuple[int, int]:
    """(min, max) capacity in full-block units worth sweeping: from two KDA checkpoints (a hybrid cache
    smaller than that holds almost nothing) to everything the workload could store, checkpoints included
    (one per request, a rough ceiling)."""
    block_size = effective_block_size(requests, spec, block_size)
    unique = unique_blocks(requests, spec, block_size)
    if not spec.hybrid:
        return 1, unique
    ck_blocks = math.ceil(spec.kda_bytes_per_checkpoint / (spec.mla_bytes_per_token * block_size))
    return 2 * ck_blocks, unique + len(requests) * ck_blocks


def _row(
    spec: ModelSpec, policy: str, ck: str, capacity: int, unit: str, cap_bytes: int, d: dict[str, Any]
) -> dict[str, Any]:
    row = {k: d.get(k, "") for k in ROW_FIELDS}
    row.update(spec=spec.name, policy=policy, checkpoints=ck, capacity=capacity, capacity_unit=unit)
    row["capacity_bytes"] = cap_bytes
    return row


def check_policies(policies: Sequence[str]) -> None:
    """Every name is an online eviction policy, an offline one or ``optimum``; else the valid ones."""
    valid = [*sorted(POLICIES), *YARDSTICKS, *OFFLINE_POLICIES, "optimum"]
    for p in policies:
        if p not in valid:
            raise ReplayError(f"unknown eviction policy {p!r}; choose one of {', '.join(valid)}")


def capacity_sweep(
    requests: Sequence[Request],
    spec: ModelSpec,
    capacities: Sequence[int],
    unit: str,
    policies: Sequence[str],
    checkpoints: CheckpointPolicy,
    block_size: int | None = None,
    progress: ProgressFactory | None = None,
    points: PointProgress | None = None,
    hints: bool = True,
    jobs: int | None = 1,
    watermarks: tuple[float, float] = (0.95, 0.85),
    ray: str | None = None,
    ray_stall_s: float | None = None,
) -> list[dict[str, Any]]:
    """One row per (policy, capacity); ``reference`` and ``bound`` run the offline schedules of
    ``kvpool.workloads.offline`` (real bytes), ``optimum`` the MLA-only MIN (unit blocks, checkpoints
    free). ``hints``: the online policies honour the requests' retention hints (the offline ones need
    none: they know the future). ``watermarks``: (high, low) of the online policies' index. ``jobs``:
    points at once in a process pool (None: the machine's cores); LRU points that the one-pass curve
    (``lru_curve``) computes exactly are not simulated at all. ``ray``: a Ray address (or ``auto``) runs the
    points as Ray tasks instead (``workloads/parallel_ray.py``), same rows; ``ray_stall_s``: how long no
    point may finish before the sweep is called stuck (None: ``parallel_ray.STALL_FLOOR_S``)."""
    tasks = [(p, checkpoints, cap) for p in policies for cap in capacities]
    return _sweep(
        requests, spec, unit, tasks, block_size, progress, points, hints, jobs, watermarks, ray, ray_stall_s
    )


def _sweep(
    requests: Sequence[Request],
    spec: ModelSpec,
    unit: str,
    tasks: Sequence[tuple[str, CheckpointPolicy, int]],
    block_size: int | None,
    progress: ProgressFactory | None,
    points: PointProgress | None,
    hints: bool,
    jobs: int | None,
    watermarks: tuple[float, float],
    ray: str | None = None,
    ray_stall_s: float | None = None,
) -> list[dict[str, Any]]:
    """Rows of (policy, checkpoint policy, capacity) tasks, in their order: the one-pass LRU curve where
    it is exact, then every other point, in a pool when ``jobs`` != 1."""
    check_policies([t[0] for t in tasks])
    bs = effective_block_size(requests, spec, block_size)
    full_block_bytes = spec.mla_bytes_per_token * bs
    rows: list[dict[str, Any] | None] = [None] * len(tasks)
    rows_by_curve = _one_pass(requests, spec, unit, tasks, bs, hints, watermarks)
    for i, (row, seconds) in rows_by_curve.items():
        rows[i] = row
        if points is not None:
            points.finished(f"lru one pass ({tasks[i][2]} {unit})", int(row["capacity_bytes"]), seconds)
    todo = [i for i in range(len(tasks)) if rows[i] is None]
    specs = [(*tasks[i], unit, bs, hints, watermarks) for i in todo]
    # the offline schedules' backward pass (chains, next uses, stops) does not depend on the capacity:
    # built once here, read by every offline point (forked workers inherit it)
    plan = offline_plan(requests, spec, bs) if any(s[0] in OFFLINE_POLICIES for s in specs) else None
    # likewise the trace's block hashes, for every simulated point
    simulated = any(s[0] not in (*OFFLINE_POLICIES, "optimum") for s in specs)
    chains = warmed_builder(requests, spec.name, bs) if simulated else None

    took: dict[int, float | None] = {}
    shown = [0]  # points reported so far, in task order

    def done(k: int, row: dict[str, Any], seconds: float | None) -> None:
        """Keep the row; report finished points in task order (a point that finishes before an earlier
        one waits for it), so the lines read the same whichever worker is faster, e.g. an offline point
        on the shared plan overtaking a simulation."""
        rows[todo[k]] = row
        took[k] = seconds
        while points is not None and shown[0] in took:
            j = shown[0]
            policy, ck = specs[j][0], specs[j][1]
            ck_label = "" if policy in (*OFFLINE_POLICIES, "optimum") else f" ({ck.label})"
            points.finished(f"{policy}{ck_label}", int(rows[todo[j]]["capacity_bytes"]), took.pop(j))
            shown[0] += 1

    if ray is not None:
        from kvpool.workloads.parallel_ray import STALL_FLOOR_S, run_points_ray

        if specs:
            stall_s = STALL_FLOOR_S if ray_stall_s is None else ray_stall_s
            run_points_ray(_task, (requests, spec, plan, chains), specs, ray, done, stall_floor_s=stall_s)
    elif jobs == 1:  # here, with the per-request progress bars
        for k, (policy, ck, cap, *_) in enumerate(specs):
            prog = progress(f"{policy} @ {cap} {unit}") if progress else None
            if points is not None:
                points.begin()
            cap_bytes = cap * full_block_bytes if unit == "blocks" else cap
            row = _point(
                requests, spec, policy, ck, cap, unit, cap_bytes, bs, prog, hints, watermarks, plan, chains
            )
            done(k, row, None)
    else:
        run_points(_task, (requests, spec, plan, chains), specs, jobs, done)
    return [r for r in rows if r is not None]


def _one_pass(
    requests: Sequence[Request],
    spec: ModelSpec,
    unit: str,
    tasks: Sequence[tuple[str, CheckpointPolicy, int]],
    bs: int,
    hints: bool,
    watermarks: tuple[float, float],
) -> dict[int, tuple[dict[str, Any], float]]:
    """Rows (and the pass's seconds, shared) of the LRU tasks that the one-pass curve computes exactly;
    ``KVPOOL_LRU_ONE_PASS=0`` turns it off (to time or check the per-point path)."""
    lru = [i for i, t in enumerate(tasks) if t[0] == "lru"]
    if not lru or os.environ.get("KVPOOL_LRU_ONE_PASS", "1") == "0":
        return {}
    cfg = SimConfig(spec=spec, policy="lru", capacity_unit=unit, block_size=bs, hints=hints,
                    high_watermark=watermarks[0], low_watermark=watermarks[1])  # fmt: skip
    if refusal(cfg, requests) is not None:
        return {}
    start = time.monotonic()
    by_ck: dict[str, list[int]] = {}
    for i in lru:
        by_ck.setdefault(tasks[i][1].label, []).append(i)
    out: dict[int, tuple[dict[str, Any], float]] = {}
    for idxs in by_ck.values():  # checkpoint policies do not apply to a pure-MLA spec: one pass serves all
        curve, _ = lru_curve(requests, cfg, [tasks[i][2] for i in idxs], bs)
        seconds = time.monotonic() - start
        for i in idxs:
            point = curve.get(tasks[i][2])
            if point is not None:
                row = _row(spec, "lru", "n/a", point.capacity, unit, int(point.capacity_bytes or 0),
                           point.to_dict())  # fmt: skip
                out[i] = (row, seconds)
    return out


def _task(shared: tuple[Sequence[Request], ModelSpec, Any, Any], task: tuple[Any, ...]) -> dict[str, Any]:
    """One sweep point in a worker of the pool (no per-request progress bar there); ``shared`` is the
    trace, the spec, the offline plan (None when the sweep has no offline point) and the trace's chains
    (None when it simulates nothing)."""
    requests, spec, plan, chains = shared
    policy, ck, cap, unit, bs, hints, watermarks = task
    cap_bytes = cap * spec.mla_bytes_per_token * bs if unit == "blocks" else cap
    return _point(requests, spec, policy, ck, cap, unit, cap_bytes, bs, None, hints, watermarks, plan, chains)


def _point(
    requests: Sequence[Request],
    spec: ModelSpec,
    policy: str,
    checkpoints: CheckpointPolicy,
    cap: int,
    unit: str,
    cap_bytes: int,
    bs: int,
    prog: Callable[[int, int], None] | None,
    hints: bool = True,
    watermarks: tuple[float, float] = (0.95, 0.85),
    plan: Any = None,
    chains: ChainBuilder | None = None,
) -> dict[str, Any]:
    """One sweep row: an offline schedule (on ``plan``, :func:`offline_plan`, when given), the MLA-only
    optimum, or a simulation (on ``chains``, :func:`warmed_builder`, when given)."""
    if policy in OFFLINE_POLICIES:
        d = run_offline(policy, requests, cap_bytes, spec, bs, progress=prog, plan=plan).to_dict()
        d["duration_s"] = _duration(requests)
        return _row(spec, policy, "offline", cap, unit, cap_bytes, d)
    if policy == "optimum":
        blocks = cap if unit == "blocks" else cap // (spec.mla_bytes_per_token * bs)
        d = optimum(requests, blocks, spec.name, bs, progress=prog).total.to_dict()
        d["duration_s"] = _duration(requests)
        return _row(spec, "optimum", "n/a", cap, unit, cap_bytes, d)
    cfg = SimConfig(spec=spec, policy=policy, capacity=cap, capacity_unit=unit, block_size=bs,
                    checkpoints=checkpoints, hints=hints, high_watermark=watermarks[0],
                    low_watermark=watermarks[1])  # fmt: skip
    d = simulate(requests, cfg, prog, chains=chains).to_dict()
    return _row(spec, policy, checkpoints.label if spec.hybrid else "n/a", cap, unit, cap_bytes, d)


def checkpoint_sweep(
    requests: Sequence[Request],
    spec: ModelSpec,
    capacities: Sequence[int],
    unit: str,
    policy: str,
    checkpoint_policies: Sequence[CheckpointPolicy],
    block_size: int | None = None,
    progress: ProgressFactory | None = None,
    points: PointProgress | None = None,
    jobs: int | None = 1,
) -> list[dict[str, Any]]:
    """One row per (checkpoint policy, capacity) for a hybrid spec under one eviction policy."""
    if not spec.hybrid:
        raise ReplayError(f"spec {spec.name} has no KDA layers: checkpoint policies do not apply")
    tasks = [(policy, ck, cap) for ck in checkpoint_policies for cap in capacities]
    return _sweep(requests, spec, unit, tasks, block_size, progress, points, True, jobs, (0.95, 0.85))


def _duration(requests: Sequence[Request]) -> float:
    if not requests:
        return 0.0
    arrivals = [r.arrival_ms for r in requests]
    return (max(arrivals) - min(arrivals)) / 1000.0


def write_csv(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(ROW_FIELDS))
        w.writeheader()
        for row in rows:
            w.writerow({k: row.get(k, "") for k in ROW_FIELDS})


def read_csv(path: str | Path) -> list[dict[str, Any]]:
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            return list(csv.DictReader(fh))
    except OSError as e:
        raise ReplayError(f"{path}: cannot read sweep CSV ({e.strerror or e})") from None


def plot_rows(
    rows: Sequence[dict[str, Any]],
    path: str | Path,
    group: str,
    metric: str = "token_hit_rate",
    title: str = "",
) -> None:
    """Hit rate vs capacity, one line per value of ``group`` (``policy`` or ``checkpoints``); x in GiB of
    the spec's bytes (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    groups: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        x = float(row["capacity_bytes"]) / 2**30
        groups.setdefault(str(row[group]), []).append((x, float(row[metric])))
    for k, (name, pts) in enumerate(groups.items()):
        pts.sort()
        if name == "optimum":
            style: dict[str, Any] = {"linestyle": ":", "color": "black"}
        else:  # a marker and a dash pattern per line, so coinciding lines stay distinguishable
            style = {"marker": MARKERS[k % len(MARKERS)], "linestyle": DASHES[k % len(DASHES)],
                     "markersize": 7 - k % 3, "markerfacecolor": "none" if k % 2 else None}  # fmt: skip
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **style)
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (GiB)")
    ax.set_ylabel(metric.replace("_", " "))
    top = max((float(r[metric]) for r in rows), default=0.0)
    ax.set_ylim(0, min(1.0, max(0.1, math.ceil(top * 10 + 0.5) / 10)))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title=group, fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
