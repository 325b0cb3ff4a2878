"""Store benchmark: kvpool's data plane per transport, side by side with its baselines, in one run.

    .venv/bin/python bench/store_bench.py                 # full run (3 rounds, ~4-5 min on 2 cores)
    .venv/bin/python bench/store_bench.py --quick         # smoke: 1 round, 3 reps, 200k objects
    .venv/bin/python bench/store_bench.py --sizes 4 --reps 10 --skip-mooncake --json-only

What it measures (put and get GB/s for each object size, 1 GB = 1e9 B):

* ``memcpy``: ``np.copyto`` from a ring of buffers bigger than L3: the physical limit of moving an object.
* ``socket``: a plain blocking TCP socket pair: the ceiling for any TCP data plane written in Python.
* ``redis``: ``redis-server`` (started here, persistence off) through redis-py SET/GET.
* ``mooncake``: Mooncake Store over TCP (own venv, installed on demand; skipped with the reason otherwise).
* ``tcp`` / ``shm`` / ``ucx``: kvpool's own master + storage node (their CLIs) through the store client.
* ``tcp_auth`` / ``shm_auth``: the same with a cluster secret required (runtime/cluster_auth.py): the cost
  of authenticated internal traffic, as ``*_auth_*_over_*`` ratios against the rows of the same run.
* ``match_prefix`` p50/p99 latency over gRPC for a 2,000-block chain, and master RSS per indexed object.

Each family runs in its own child process with a deadline; when it fails or runs late the child (and every
server it started, same process group) is killed, the family is reported as ``skipped: <why>`` and the rest
still runs. Every number comes from warm-ups + timed reps (median), each rep verified byte for byte; see
``store_common.time_reps``. The last stdout line is one JSON object with every number, the 4 MB ratios and
the pass/fail of each goal (docs/measurements/store_bench.md explains the method and the goals).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvpool.workloads.progress import StepProgress
from store_common import (
    DEFAULT_REPS,
    DEFAULT_WARMUP,
    QUICK_REPS,
    QUICK_WARMUP,
    Plan,
    Row,
    alarm,
    emit_result,
    parse_result,
)

# name -> (module, function, deadline in seconds for the full plan, deadline for --quick)
SECTIONS: dict[str, tuple[str, str, int, int]] = {
    "memcpy": ("store_baselines", "section_memcpy", 240, 90),
    "socket": ("store_baselines", "section_socket", 240, 90),
    "redis": ("store_baselines", "section_redis", 300, 120),
    "mooncake": ("store_baselines", "section_mooncake", 900, 600),
    "tcp": ("store_ours", "section_tcp", 360, 150),
    "tcp_auth": ("store_ours", "section_tcp_auth", 360, 150),
    "shm": ("store_ours", "section_shm", 360, 150),
    "shm_auth": ("store_ours", "section_shm_auth", 360, 150),
    "ucx": ("store_ours", "section_ucx", 420, 180),
    "push": ("store_ours", "section_push", 600, 300),
    "match_prefix": ("store_ours_master", "section_match_prefix", 240, 120),
    "master_memory": ("store_ours_master", "section_master_memory", 900, 300),
}
GOAL_SIZE_MB = 4  # the size the issue states its ratio goals at
GOALS = {
    "shm_get_ge_50pct_memcpy": "shm get >= 0.5 x memcpy (4 MB)",
    "tcp_ge_2x_redis": "tcp put and get >= 2 x Redis (4 MB)",
    "ucx_ge_2x_redis": "ucx put and get >= 2 x Redis (4 MB)",
    "tcp_ge_2x_mooncake": "tcp put and get >= 2 x Mooncake Store (4 MB)",
    "ucx_ge_2x_mooncake": "ucx put and get >= 2 x Mooncake Store (4 MB)",
    "shm_push_ge_60pct_memcpy": "shm prefill push >= 0.6 x memcpy (largest size)",
    "tcp_push_ge_90pct_socket": "tcp prefill push >= 0.9 x plain socket put (largest size)",
    "match_prefix_p50_le_1ms": "match_prefix p50 <= 1 ms (2,000-block chain)",
    "master_bytes_per_object_le_256": "master memory <= 256 B per object",
}


# ------------------------------------------------------------------------------------------- child side


def run_section_child(name: str, plan: Plan, deadline_s: float) -> int:
    """Body of a section child: run one family and print its marked result line, whatever happens."""
    module, func, _, _ = SECTIONS[name]
    t0 = time.monotonic()

    def _on_term(_sig: int, _frame: object) -> None:
        raise SystemExit(f"{name}: terminated by the parent's deadline")

    signal.signal(signal.SIGTERM, _on_term)  # unwind: `children()` stops the servers it started
    try:
        with alarm(deadline_s, name):
            fn = getattr(__import__(module), func)
            res = fn(plan)
    except Exception as exc:  # any failure is a skip with its reason, never a partial number
        res = {"rows": [], "skipped": {name: f"{type(exc).__name__}: {exc}"}}
    res["seconds"] = round(time.monotonic() - t0, 1)
    emit_result(res)
    return 0


# ------------------------------------------------------------------------------------------ parent side


def run_section(name: str, plan: Plan, timeout_s: int, log: bool) -> dict[str, Any]:
    """Run one family in a child process (own session) and kill its whole process group at the deadline."""
    cmd = [
        sys.executable,
        __file__,
        "--_section",
        name,
        "--_plan",
        json.dumps(plan.to_json()),
        "--_deadline",
        str(max(10, timeout_s - 15)),
    ]
    if log:
        print(f"[store_bench] {name} ... (deadline {timeout_s}s)", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # the child's group: the child and the servers it started. SIGTERM first, so a storage node
        # unlinks its shared-memory pool and the child's cleanup runs; SIGKILL whatever is left.
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        res = {"rows": [], "skipped": {name: f"timed out after {timeout_s}s"}}
    else:
        res = parse_result(out) or {
            "rows": [],
            "skipped": {
                name: f"child exited rc={proc.returncode} without a result: "
                f"{' | '.join(err.strip().splitlines()[-2:])}"
            },
        }
    _reap_group(proc.pid)  # a server that outlived its section must not skew the next one
    res.setdefault("seconds", round(time.monotonic() - t0, 1))
    if log:
        skipped = res.get("skipped") or {}
        what = "; ".join(f"skipped {k}: {v}" for k, v in skipped.items())
        what = what or f"{len(res.get('rows', []))} row(s)"
        print(f"[store_bench] {name}: {what} ({res['seconds']}s)", file=sys.stderr, flush=True)
    return res


def _signal_group(pgid: int, sig: int) -> bool:
    """Signal a section's process group (created by us with start_new_session); False if it is gone."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def _reap_group(pgid: int, grace_s: float = 5.0) -> None:
    """Stop anything left in a finished section's group: SIGTERM, a grace period, then SIGKILL."""
    if not _signal_group(pgid, signal.SIGTERM):
        return
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        time.sleep(0.1)
        if not _signal_group(pgid, 0):
            return
    _signal_group(pgid, signal.SIGKILL)


def _cell(row: Row | None, op: str, size: int) -> float | None:
    if row is None:
        return None
    return (row.put if op == "put" else row.get).get(size)


def _largest_put(row: Row | None) -> float | None:
    """A row's put rate at its largest measured size: the limit a push (one large batch) is held against."""
    sizes = [k for k, v in (row.put if row else {}).items() if v]
    return _cell(row, "put", max(sizes)) if sizes else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else round(a / b, 3)


def _best(rows: dict[str, Row], ids: tuple[str, ...]) -> Row | None:
    """Merge rows cell by cell keeping the faster value: the baseline at its best (generous to it)."""
    found = [rows[i] for i in ids if i in rows]
    if not found:
        return None
    best = Row(found[0].id, found[0].method)
    for r in found:
        for src, dst in ((r.put, best.put), (r.get, best.get)):
            for k, v in src.items():
                if v is not None and (dst.get(k) is None or v > dst[k]):
                    dst[k] = v
    return best


def summarize(rows: dict[str, Row], extras: dict[str, Any]) -> tuple[dict[str, Any], dict[str, bool | None]]:
    """Ratios at the goal size and the pass/fail (None = not evaluated) of every goal in the issue."""
    s = GOAL_SIZE_MB
    memcpy, shm, tcp, ucx, redis = (rows.get(k) for k in ("memcpy", "shm", "tcp", "ucx", "redis"))
    mooncake = _best(rows, ("mooncake", "mooncake_zc"))
    ratios: dict[str, Any] = {
        "size_mb": s,
        "shm_get_over_memcpy": _ratio(_cell(shm, "get", s), _cell(memcpy, "get", s)),
    }
    for ours_id, ours in (("tcp", tcp), ("ucx", ucx)):
        for base_id, base in (("redis", redis), ("mooncake", mooncake)):
            for op in ("put", "get"):
                ratios[f"{ours_id}_{op}_over_{base_id}_{op}"] = _ratio(_cell(ours, op, s), _cell(base, op, s))
    for t in ("tcp", "shm"):  # the cluster secret's cost: same transport, same run, auth on over off
        for op in ("put", "get"):
            ratios[f"{t}_auth_{op}_over_{t}_{op}"] = _ratio(
                _cell(rows.get(f"{t}_auth"), op, s), _cell(rows.get(t), op, s)
            )
    push = (extras.get("push") or {}).get("gbps", {})
    socket = rows.get("socket")
    ratios["shm_push_over_memcpy"] = _ratio(push.get("shm", {}).get("batch"), _largest_put(memcpy))
    ratios["tcp_push_over_socket"] = _ratio(push.get("tcp", {}).get("batch"), _largest_put(socket))
    for t, modes in push.items():
        ratios[f"{t}_push_batch_over_sequential"] = _ratio(modes.get("batch"), modes.get("sequential"))
        if "tensors_parts" in modes:
            ratios[f"{t}_push_parts_over_assembled"] = _ratio(
                modes.get("tensors_parts"), modes.get("tensors_assembled")
            )
    mp = extras.get("match_prefix") or {}
    mem = extras.get("master_memory") or {}
    ratios["match_prefix_p50_ms"] = mp.get("p50_ms")
    ratios["master_bytes_per_object"] = mem.get("bytes_per_object")

    def at_least(keys: list[str], floor: float) -> bool | None:
        vals = [ratios[k] for k in keys]
        return None if any(v is None for v in vals) else all(v >= floor for v in vals)

    def at_most(v: float | None, cap: float) -> bool | None:
        return None if v is None else v <= cap

    goals: dict[str, bool | None] = {
        "shm_get_ge_50pct_memcpy": at_least(["shm_get_over_memcpy"], 0.5),
        "shm_push_ge_60pct_memcpy": at_least(["shm_push_over_memcpy"], 0.6),
        "tcp_push_ge_90pct_socket": at_least(["tcp_push_over_socket"], 0.9),
        "match_prefix_p50_le_1ms": at_most(ratios["match_prefix_p50_ms"], 1.0),
        "master_bytes_per_object_le_256": at_most(ratios["master_bytes_per_object"], 256),
    }
    for ours_id in ("tcp", "ucx"):
        for base_id in ("redis", "mooncake"):
            goals[f"{ours_id}_ge_2x_{base_id}"] = at_least(
                [f"{ours_id}_{op}_over_{base_id}_{op}" for op in ("put", "get")], 2.0
            )
    return ratios, {k: goals[k] for k in GOALS}


def median_row(rounds: list[Row]) -> Row:
    """Cell-wise median over rounds (the VM's TCP paths swing +-30-50 % between rounds, overview §5)."""
    out = Row(rounds[0].id, rounds[0].method, note=rounds[0].note)
    for op in ("put", "get"):
        cells: dict[int, list[float]] = {}
        for r in rounds:
            for k, v in getattr(r, op).items():
                if v is not None:
                    cells.setdefault(k, []).append(v)
        getattr(out, op).update({k: statistics.median(v) for k, v in cells.items()})
        if len(rounds) > 1:
            out.spread[op] = {k: [min(v), max(v)] for k, v in cells.items()}
    if len(rounds) > 1:
        out.note = f"{out.note}; median of {len(rounds)} rounds".lstrip("; ")
    return out


def median_extra(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """match_prefix / memory / push figures: the first round's record with its latencies and rates replaced
    by medians."""
    out = dict(rounds[0])
    if "gbps" in out:  # push: transport -> mode -> GB/s
        out["gbps"] = {
            t: {
                m: round(statistics.median(r["gbps"][t][m] for r in rounds if t in r["gbps"]), 3)
                for m in modes
            }
            for t, modes in out["gbps"].items()
        }
    for k in ("p50_ms", "p99_ms", "min_ms", "one_block_p50_ms"):
        vals = [r[k] for r in rounds if isinstance(r.get(k), int | float)]
        if vals:
            out[k] = round(statistics.median(vals), 3)
    out["rounds"] = len(rounds)
    return out


def plan_rounds(args: argparse.Namespace) -> int:
    return max(1, args.rounds if args.rounds is not None else (1 if args.quick else 3))


def render_table(rows: list[Row], sizes: list[int]) -> str:
    """Rows = methods, columns = sizes x (put, get), GB/s; '-' where a cell was not measured."""
    head = ["method"] + [f"{s}MB {op}" for s in sizes for op in ("put", "get")]
    body = [
        [r.method]
        + [("-" if (v := _cell(r, op, s)) is None else f"{v:.2f}") for s in sizes for op in ("put", "get")]
        for r in rows
    ]
    widths = [max(len(str(line[c])) for line in [head, *body]) for c in range(len(head))]
    fmt = "  ".join(["{:<" + str(widths[0]) + "}"] + ["{:>" + str(w) + "}" for w in widths[1:]])
    lines = [fmt.format(*head), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*line) for line in body]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,16,64", help="object sizes in MB, comma-separated")
    ap.add_argument(
        "--reps", type=int, default=None, help="timed reps per size (default 30/20/10/6 for 1/4/16/64 MB)"
    )
    ap.add_argument(
        "--warmup", type=int, default=None, help=f"untimed warm-ups per size (default {DEFAULT_WARMUP})"
    )
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: few reps, one round, smaller memory test"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="repeat every section this many times, interleaved; cells are medians (default 3; --quick 1)",
    )
    ap.add_argument("--json-only", action="store_true", help="print only the final JSON line")
    ap.add_argument("--skip-mooncake", action="store_true", help="do not install or run Mooncake Store")
    ap.add_argument("--only", default="", help=f"comma-separated subset of: {','.join(SECTIONS)}")
    ap.add_argument(
        "--objects",
        type=int,
        default=None,
        help="objects indexed for the master-memory test (default 1,000,000; --quick 200,000)",
    )
    ap.add_argument("--_section", help=argparse.SUPPRESS)
    ap.add_argument("--_plan", help=argparse.SUPPRESS)
    ap.add_argument("--_deadline", type=float, default=300, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or any(s <= 0 for s in sizes):
        raise SystemExit("--sizes: positive integers (MB), e.g. 1,4,16,64")
    if args.reps is not None:
        reps = dict.fromkeys(sizes, max(1, args.reps))
    elif args.quick:
        reps = dict.fromkeys(sizes, QUICK_REPS)
    else:
        reps = {s: DEFAULT_REPS.get(s, max(3, 64 // s)) for s in sizes}
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if args.quick else DEFAULT_WARMUP)
    objects = args.objects if args.objects is not None else (200_000 if args.quick else 1_000_000)
    return Plan(sizes_mb=sizes, reps=reps, warmup=max(0, warmup), quick=args.quick, objects=objects)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._section:
        return run_section_child(args._section, Plan.from_json(json.loads(args._plan)), args._deadline)
    plan = make_plan(args)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"--only: unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    log = not args.json_only
    load_start = [round(x, 2) for x in os.getloadavg()]  # other work on the box skews every number
    skipped: dict[str, str] = {}
    seconds: dict[str, float] = {}
    if args.skip_mooncake and "mooncake" in names:
        names.remove("mooncake")
        skipped["mooncake"] = "--skip-mooncake"
    per_round: dict[str, list[Row]] = {}
    extra_rounds: dict[str, list[dict[str, Any]]] = {}
    dead: set[str] = set()  # a section that could not run at all is not retried in later rounds
    progress = StepProgress(plan_rounds(args) * len(names), "store_bench")
    for rnd in range(plan_rounds(args)):
        for name in names:
            if name in dead or (rnd > 0 and name == "master_memory"):  # 1 M objects: once is enough
                progress.finished(f"round {rnd + 1} {name} (skipped)")
                continue
            full_t, quick_t = SECTIONS[name][2:]
            res = run_section(name, plan, quick_t if plan.quick else full_t, log)
            progress.finished(f"round {rnd + 1} {name}")
            seconds[name] = round(seconds.get(name, 0) + res.get("seconds", 0), 1)
            got_rows = res.get("rows", [])
            for r in got_rows:
                row = Row.from_json(r)
                per_round.setdefault(row.id, []).append(row)
            for k in ("match_prefix", "master_memory", "push"):
                if res.get(k):
                    extra_rounds.setdefault(k, []).append(res[k])
            why = res.get("skipped") or {}
            measured = got_rows or any(k in res for k in ("match_prefix", "master_memory", "push"))
            if rnd == 0 and why and not measured:
                dead.add(name)
            skipped.update(why if rnd == 0 else {f"{k} (round {rnd + 1})": v for k, v in why.items()})
    rows = {k: median_row(v) for k, v in per_round.items()}
    extras = {k: median_extra(v) for k, v in extra_rounds.items()}
    ratios, goals = summarize(rows, extras)
    order = ["memcpy", "memcpy_hot", "socket", "redis", "mooncake", "mooncake_zc", "tcp", "shm", "ucx"]
    ordered = [rows[k] for k in order if k in rows] + [r for k, r in rows.items() if k not in order]
    if log:
        print()
        if ordered:
            print(render_table(ordered, plan.sizes_mb))
        mp, mem, push = extras.get("match_prefix"), extras.get("master_memory"), extras.get("push")
        if push:
            print(
                f"\nprefill push ({push['objects']} objects, {push['bytes'] / 2**20:,.0f} MiB, K3 shape x "
                f"{push['scale']}), GB/s batched | one by one: "
                + ", ".join(f"{t} {m['batch']:.2f} | {m['sequential']:.2f}" for t, m in push["gbps"].items())
            )
            from_tensors = {t: m for t, m in push["gbps"].items() if "tensors_parts" in m}
            if from_tensors:
                print(
                    "  from the worker's tensors, GB/s units assembled first | put as parts: "
                    + ", ".join(
                        f"{t} {m['tensors_assembled']:.2f} | {m['tensors_parts']:.2f}"
                        for t, m in from_tensors.items()
                    )
                )
        if mp:
            print(
                f"\nmatch_prefix, {mp.get('chain_blocks')}-block chain through the client (master wire): "
                f"p50 {mp.get('p50_ms')} ms, "
                f"p99 {mp.get('p99_ms')} ms ({mp.get('calls')} calls; usable={mp.get('usable_blocks')}; "
                f"1-block call p50 {mp.get('one_block_p50_ms')} ms)"
            )
        if mem:
            print(
                f"master memory: {mem.get('bytes_per_object')} B/object over {mem.get('objects')} objects "
                f"({mem.get('method')})"
            )
            proc = mem.get("master_process")
            if proc:
                print(
                    f"  cross-check, whole master process: {proc.get('bytes_per_object')} B/object "
                    f"(RSS {proc.get('rss_before_mb')} -> {proc.get('rss_after_mb')} MB, "
                    f"{proc.get('method')})"
                )
        for k, why in skipped.items():
            print(f"skipped: {k}: {why}")
        print()
        for k, desc in GOALS.items():
            v = goals[k]
            print(f"goal {'PASS' if v else ('FAIL' if v is False else 'n/a ')}  {desc}")
        print()
    summary = {
        "bench": "store",
        "utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "loadavg_start": load_start,
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        },
        "plan": {**plan.to_json(), "rounds": plan_rounds(args)},
        "unit": "GB/s (1e9 B/s), median of timed reps (median over rounds), every rep verified",
        "rows": [r.to_json() for r in ordered],
        "match_prefix": extras.get("match_prefix"),
        "push": extras.get("push"),
        "master_memory": extras.get("master_memory"),
        "ratios": ratios,
        "goals": goals,
        "skipped": skipped,
        "seconds": seconds,
    }
    print(json.dumps(summary, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
