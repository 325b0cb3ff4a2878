"""Capacity sweeps: hit rate vs cache capacity per eviction policy (with the offline optimum as the
physical limit) and per checkpoint policy (in K3 bytes), written as CSV rows and PNG plots.

Every point is an independent :func:`simulate` run (a fresh index), so rows are reproducible one by one.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvpool.kvstore.index.eviction import POLICIES
from kvpool.worker.checkpoint_policy import CheckpointPolicy
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.labels import YARDSTICKS
from kvpool.workloads.offline import OFFLINE_POLICIES, run_offline
from kvpool.workloads.optimum import optimum
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
    from kvpool.workloads.chains import ChainBuilder

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
) -> list[dict[str, Any]]:
    """One row per (policy, capacity); ``reference`` and ``bound`` run the offline schedules of
    ``kvpool.workloads.offline`` (real bytes), ``optimum`` the MLA-only MIN (unit blocks, checkpoints
    free). ``hints``: the online policies honour the requests' retention hints (the offline ones need
    none: they know the future)."""
    check_policies(policies)
    bs = effective_block_size(requests, spec, block_size)
    full_block_bytes = spec.mla_bytes_per_token * bs
    rows = []
    for policy in policies:
        for cap in capacities:
            label = f"{policy} @ {cap} {unit}"
            prog = progress(label) if progress else None
            cap_bytes = cap * full_block_bytes if unit == "blocks" else cap
            if points is not None:
                points.begin()
            rows.append(_point(requests, spec, policy, checkpoints, cap, unit, cap_bytes, bs, prog, hints))
            if points is not None:
                ck_label = "" if policy in (*OFFLINE_POLICIES, "optimum") else f" ({checkpoints.label})"
                points.finished(f"{policy}{ck_label}", cap_bytes)
    return rows


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
) -> dict[str, Any]:
    """One sweep row: an offline schedule, the MLA-only optimum, or a simulation."""
    if policy in OFFLINE_POLICIES:
        d = run_offline(policy, requests, cap_bytes, spec, bs, progress=prog).to_dict()
        d["duration_s"] = _duration(requests)
        return _row(spec, policy, "offline", cap, unit, cap_bytes, d)
    if policy == "optimum":
        blocks = cap if unit == "blocks" else cap // (spec.mla_bytes_per_token * bs)
        d = optimum(requests, blocks, spec.name, bs, progress=prog).total.to_dict()
        d["duration_s"] = _duration(requests)
        return _row(spec, "optimum", "n/a", cap, unit, cap_bytes, d)
    cfg = SimConfig(spec=spec, policy=policy, capacity=cap, capacity_unit=unit, block_size=bs,
                    checkpoints=checkpoints, hints=hints)  # fmt: skip
    d = simulate(requests, cfg, prog).to_dict()
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
) -> list[dict[str, Any]]:
    """One row per (checkpoint policy, capacity) for a hybrid spec under one eviction policy."""
    if not spec.hybrid:
        raise ReplayError(f"spec {spec.name} has no KDA layers: checkpoint policies do not apply")
    rows = []
    for ck in checkpoint_policies:
        rows.extend(
            capacity_sweep(requests, spec, capacities, unit, [policy], ck, block_size, progress, points)
        )
    return rows


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
