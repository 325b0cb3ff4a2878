"""``kvpool replay``: a trace simulated through the master's own index, or replayed against a live gateway;
hit rates per workload and tenant as tables or JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
from pathlib import Path
from typing import Any

from kvpool.kvstore.shards import DEFAULT_DEPTH, ShardSet, ShardSetError
from kvpool.workloads.commands.common import (
    STREAM_ABOVE_BYTES,
    add_jobs_flag,
    add_progress_flags,
    add_tier_flags,
    guard,
    load_requests,
    memory_estimate,
    parse_size,
    print_json,
    progress_factory,
    stream_requests,
    ttft_model,
)
from kvpool.workloads.commands.replay_tables import print_live_table, print_sim_table, print_sweep_rows
from kvpool.workloads.errors import ReplayError


def _capacities(text: str | None, unit: str, reqs: list, spec: Any, block_size: int) -> list[int] | None:
    from kvpool.workloads.sweep import auto_capacities, sweep_range

    if text is None:
        return None
    if text.strip() == "auto":
        lo, hi = sweep_range(reqs, spec, block_size)
        caps = auto_capacities(hi, 8, lo)
        if unit == "bytes":
            caps = [c * spec.mla_bytes_per_token * block_size for c in caps]
        return caps
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if unit == "bytes":
            out.append(parse_size(part))
        else:
            try:
                value = int(part)
            except ValueError:
                raise ReplayError(f"--capacity-blocks takes integers or 'auto', got {part!r}") from None
            if value <= 0:
                raise ReplayError(f"--capacity-blocks must be > 0, got {value}")
            out.append(value)
    if not out:
        raise ReplayError("empty capacity list")
    return out


def _positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (argparse's type for ``--ray-stall-s``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return value


@guard
def cmd_replay(args: argparse.Namespace) -> int:
    """Replay a trace, simulated (default) or live."""
    from kvpool.workloads.synthetic_tokens import with_synthetic_tokens

    if args.live and args.sim:
        raise ReplayError("choose --sim or --live, not both")
    if not args.live and _streams(args):
        return _replay_stream(args)
    reqs = load_requests(args.trace, args.limit)
    if args.live:
        from kvpool.workloads.live import replay_live

        if args.vocab:
            reqs = list(with_synthetic_tokens(reqs, args.vocab))
        summary = replay_live(
            reqs,
            args.live,
            model=args.model,
            speed=args.speed,
            concurrency=args.concurrency,
            progress=progress_factory(args)("live"),
            hints=args.hints,
        )
        if args.out:
            Path(args.out).write_text(json.dumps(summary) + "\n", encoding="utf-8")
        summary.pop("per_request", None)
        print_json(summary) if args.json else print_live_table(summary)
        return 0 if summary["errors"] == 0 else 1
    return _replay_sim(args, reqs)


def _streams(args: argparse.Namespace) -> bool:
    """One online-policy simulation at one capacity streams its trace when asked (``--stream``) or when
    the trace would take more than ``STREAM_ABOVE_BYTES`` loaded; everything else needs it whole."""
    from kvpool.kvstore.index.eviction import POLICIES
    from kvpool.workloads.trace import resolve_trace

    single = (
        "," not in args.policy
        and args.policy.strip() in POLICIES
        and args.checkpoint_sweep is None
        and args.capacity_blocks is None
        and "," not in (args.capacity_bytes or "")
        and (args.capacity_bytes or "").strip() != "auto"
    )
    if args.stream and not single:
        raise ReplayError(
            "--stream runs one simulation: one online policy "
            f"({', '.join(sorted(POLICIES))}) at one --capacity-bytes (or unbounded), no sweep"
        )
    return single and (args.stream or memory_estimate(resolve_trace(args.trace)) > STREAM_ABOVE_BYTES)


def _sim_config(args: argparse.Namespace, spec: Any, policy: str, capacity: int | None, unit: str,
                block_size: int | None) -> Any:  # fmt: skip
    from kvpool.workloads.checkpoints import parse_checkpoints
    from kvpool.workloads.sim import SimConfig

    return SimConfig(
        spec=spec,
        policy=policy,
        capacity=capacity,
        capacity_unit=unit,
        block_size=block_size,
        checkpoints=parse_checkpoints(args.checkpoints),
        high_watermark=args.high_watermark,
        low_watermark=args.low_watermark,
        store_output=not args.no_output_blocks,
        visibility_delay_ms=args.visibility_delay_ms,
        ssd_capacity=parse_size(args.ssd_bytes) if args.ssd_bytes else 0,
        ttft=ttft_model(args),
        shards=_shards(args),
        hints=args.hints,
        pin_share=args.pin_share,
        pin_budget_step=args.pin_budget_step,
        supersede=args.supersede,
    )


def _shards(args: argparse.Namespace) -> ShardSet:
    try:
        return ShardSet(args.shards, args.shard_depth)
    except ShardSetError as exc:
        raise ReplayError(str(exc)) from None


def _replay_stream(args: argparse.Namespace) -> int:
    """A single simulation fed as the file is read: memory is the index's, not the trace's."""
    from kvpool.workloads.sim import simulate
    from kvpool.workloads.specs import get_spec
    from kvpool.workloads.trace import arrival_ordered

    if args.limit is not None and args.limit <= 0:
        raise ReplayError("--limit must be > 0")
    spec = get_spec(args.spec, pure_mla=args.pure_mla)
    cap = parse_size(args.capacity_bytes) if args.capacity_bytes else None
    cfg = _sim_config(args, spec, args.policy.strip(), cap, "bytes", args.block_size)

    def run(config: Any) -> Any:
        stream = arrival_ordered(stream_requests(args.trace))
        if args.limit is not None:
            stream = itertools.islice(stream, args.limit)
        return simulate(stream, config, progress_factory(args)(f"replay {args.trace} (streamed)"))

    result = run(cfg)
    if result.total.requests == 0:
        raise ReplayError(f"{args.trace}: no requests")
    one_master = run(dataclasses.replace(cfg, shards=ShardSet())) if cfg.shards.sharded else None
    return _emit(args, result, one_master)


def _emit(args: argparse.Namespace, result: Any, one_master: Any = None) -> int:
    """Print (and with ``--out`` write) a simulation's result; a sharded one is compared with
    ``one_master``, the same replay through a single master."""
    d = result.to_dict()
    if one_master is not None:
        hit = one_master.total.to_dict()["token_hit_rate"]
        d["shards"].update(one_master_token_hit_rate=hit, token_hit_loss=hit - d["token_hit_rate"])
    if args.out:
        full = result.to_dict(per_request=True)
        full["shards"] = d["shards"]
        Path(args.out).write_text(json.dumps(full) + "\n", encoding="utf-8")
    if args.json:
        print_json(d)
    else:
        print_sim_table(d)
    return 0


def _replay_sim(args: argparse.Namespace, reqs: list) -> int:
    from kvpool.workloads.checkpoints import parse_checkpoints
    from kvpool.workloads.offline import OFFLINE_POLICIES, run_offline
    from kvpool.workloads.progress import PointProgress
    from kvpool.workloads.sim import effective_block_size, simulate
    from kvpool.workloads.specs import get_spec
    from kvpool.workloads.sweep import capacity_sweep, check_policies, checkpoint_sweep, plot_rows, write_csv

    spec = get_spec(args.spec, pure_mla=args.pure_mla)
    bs = effective_block_size(reqs, spec, args.block_size)
    if args.capacity_blocks is not None and args.capacity_bytes is not None:
        raise ReplayError("give --capacity-blocks or --capacity-bytes, not both")
    unit = "blocks" if args.capacity_blocks is not None else "bytes"
    caps = _capacities(
        args.capacity_blocks if unit == "blocks" else args.capacity_bytes, unit, reqs, spec, bs
    )
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    if args.sample is not None:
        return _replay_sampled(args, reqs, spec, policies, caps, unit, bs)
    ck = parse_checkpoints(args.checkpoints)
    progress = progress_factory(args)
    sweep = args.checkpoint_sweep is not None or len(policies) > 1 or (caps is not None and len(caps) > 1)
    if sweep:
        if _shards(args).sharded:
            raise ReplayError("--shards runs one simulation (and its one-master twin), not a sweep")
        if caps is None:
            raise ReplayError(
                "a sweep needs capacities: --capacity-blocks or --capacity-bytes (a list or 'auto')"
            )
        one_run = args.pin_share != 0.5 or args.pin_budget_step != 0.02 or args.supersede
        if one_run or (args.checkpoint_sweep is not None and not args.hints):
            raise ReplayError(
                "--pin-share, --pin-budget-step, --supersede (and --no-hints with --checkpoint-sweep) apply "
                "to one simulation"
            )
        out_dir = Path(args.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if args.checkpoint_sweep is not None:
            cks = [parse_checkpoints(t) for t in args.checkpoint_sweep.split(";") if t.strip()]
            points = PointProgress(len(cks) * len(caps), args.progress is not False)
            rows = checkpoint_sweep(reqs, spec, caps, unit, policies[0], cks, bs, progress, points, args.jobs)
            group, name = "checkpoints", "checkpoint_sweep"
        else:
            points = PointProgress(len(policies) * len(caps), args.progress is not False)
            rows = capacity_sweep(reqs, spec, caps, unit, policies, ck, bs, progress, points, args.hints,
                                  args.jobs, (args.high_watermark, args.low_watermark), args.ray,
                                  args.ray_stall_s)  # fmt: skip
            group, name = "policy", "policy_sweep"
        write_csv(rows, out_dir / f"{name}.csv")
        metric = "token_hit_rate"
        plot_rows(
            rows, out_dir / f"{name}.png", group, metric, f"{args.trace}: {metric} vs capacity ({spec.name})"
        )
        if args.json:
            print_json(
                {"rows": rows, "csv": str(out_dir / f"{name}.csv"), "png": str(out_dir / f"{name}.png")}
            )
        else:
            print_sweep_rows(rows, group)
            print(f"wrote {out_dir / (name + '.csv')} and {out_dir / (name + '.png')}")
        return 0
    if policies == ["optimum"]:
        raise ReplayError("the offline optimum runs in a sweep: add another --policy or a capacity list")
    check_policies(policies)
    if policies[0] in OFFLINE_POLICIES:
        full_block = spec.mla_bytes_per_token * bs
        cap_bytes = None if not caps else caps[0] * (full_block if unit == "blocks" else 1)
        res = run_offline(policies[0], reqs, cap_bytes, spec, bs, not args.no_output_blocks,
                          progress(f"{policies[0]} {args.trace}"))  # fmt: skip
        print_json(res.to_dict()) if args.json else print_sim_table(res.to_dict())
        return 0
    cfg = _sim_config(args, spec, policies[0], caps[0] if caps else None, unit, bs)
    result = simulate(reqs, cfg, progress(f"replay {args.trace}"))
    one_master = None
    if cfg.shards.sharded:
        one_master = simulate(reqs, dataclasses.replace(cfg, shards=ShardSet()), progress("one master"))
    return _emit(args, result, one_master)


def _replay_sampled(
    args: argparse.Namespace,
    reqs: list,
    spec: Any,
    policies: list[str],
    caps: list[int] | None,
    unit: str,
    bs: int,
) -> int:
    """``--sample R``: the one-pass LRU curve of a sample by chain root at capacities scaled by R."""
    from kvpool.workloads.sampled import MEASURED_ERROR, SAMPLE_NOTE, check_rate, sampled_lru_curve

    rate = check_rate(args.sample)
    if policies != ["lru"]:
        raise ReplayError(f"--sample takes --policy lru (the one-pass curve), got --policy {args.policy}")
    if caps is None:
        raise ReplayError(
            "--sample needs capacities: --capacity-blocks or --capacity-bytes (a list or 'auto')"
        )
    if args.checkpoint_sweep is not None or _shards(args).sharded:
        raise ReplayError("--sample runs the one-pass LRU curve: not with --checkpoint-sweep or --shards")
    cfg = _sim_config(args, spec, "lru", None, unit, bs)
    res = sampled_lru_curve(reqs, cfg, caps, bs, rate, args.sample_salt, args.sample_by, args.sample_depth)
    d = res.to_dict()
    d["measured_error"] = MEASURED_ERROR
    if args.json:
        print_json(d)
        return 0
    print(
        f"sample rate {rate:g} by {res.by} (depth {res.depth}), salt {res.salt}: {res.sampled_requests} of "
        f"{res.requests} requests"
    )
    head = f"{'capacity':>14}{'GiB':>10}{'sampled at':>12}{'block hit':>11}{'token hit':>11}"
    print(head)
    print("-" * len(head))
    for p in d["points"]:
        print(
            f"{p['capacity']!s:>14}{p['capacity_bytes'] / 2**30:>10.1f}{p['sampled_capacity']!s:>12}"
            f"{p['block_hit_rate']:>11.2%}{p['token_hit_rate']:>11.2%}"
        )
    print(f"note: {SAMPLE_NOTE}" if rate < 1 else "note: rate 1 keeps every request: the exact curve")
    print(f"measured error: {MEASURED_ERROR}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``replay`` to the ``kvpool`` command line."""
    from kvpool.workloads.specs import SPECS

    specs = sorted(SPECS)
    r = subparsers.add_parser("replay", help="replay a trace: simulated (default) or against a live gateway")
    r.add_argument("trace", help="bundled trace name (conversation, synthetic) or a JSONL file (.gz ok)")
    r.add_argument("--sim", action="store_true", help="simulate through the master's index (the default)")
    r.add_argument("--live", metavar="URL", help="OpenAI-compatible gateway base URL (instead of --sim)")
    r.add_argument("--spec", choices=specs, default="k3", help="model spec for byte sizes (default k3)")
    r.add_argument("--pure-mla", action="store_true", help="ignore KDA state: plain longest-MLA-prefix hits")
    r.add_argument("--block-size", type=int, help="tokens per block for token records (default: spec's)")
    r.add_argument("--capacity-bytes", help="capacity in bytes (512GiB, 4e12; a comma list or 'auto' sweeps)")
    r.add_argument(
        "--ssd-bytes", help="SSD tier under the DRAM capacity (e.g. 4TiB): demote on eviction, promote on hit"
    )
    r.add_argument("--capacity-blocks", help="capacity in MLA blocks (a comma list or 'auto' sweeps)")
    r.add_argument(
        "--policy",
        default="hybrid",
        help="eviction policy (hybrid: the default, return-time-aware; depth: the previous default; lru, "
        "lfu, cost), the labels yardstick (hybrid told whether each checkpoint is read again), an offline "
        "one (reference: feasible, bound: upper bound; "
        "both count checkpoint bytes), or a comma list to sweep; 'optimum' = MLA-only MIN (checkpoints free)",
    )
    r.add_argument(
        "--checkpoints",
        default="prompt,output,junction",
        help="checkpoint policy: any of prompt,output,junction,every=N or none",
    )
    r.add_argument(
        "--checkpoint-sweep", metavar="P1;P2;...", help="compare checkpoint policies (';'-separated)"
    )
    r.add_argument(
        "--high-watermark",
        type=float,
        default=0.95,
        help="eviction starts when the cache is this full (fraction)",
    )
    r.add_argument(
        "--low-watermark", type=float, default=0.85, help="eviction frees down to this fill (fraction)"
    )
    r.add_argument("--no-output-blocks", action="store_true", help="do not store blocks closed by replies")
    r.add_argument(
        "--visibility-delay-ms",
        type=float,
        default=0.0,
        help="a request's objects become visible this long after its arrival (prefill + decode time)",
    )
    r.add_argument("--limit", type=int, help="replay only the first N requests (by arrival)")
    r.add_argument(
        "--stream",
        action="store_true",
        help="read the trace as it is replayed (one online policy, one capacity); automatic for a trace "
        "too large to load",
    )
    r.add_argument(
        "--shards",
        type=int,
        default=1,
        help="master shards, each with its slice of the capacity; the result compares them with one master",
    )
    r.add_argument(
        "--shard-depth",
        type=int,
        default=DEFAULT_DEPTH,
        help=f"blocks of a chain that choose its shard (default {DEFAULT_DEPTH})",
    )
    r.add_argument(
        "--hints",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="honour the trace's client retention hints: pin retained chains within the pin budget, "
        "release a session's pins at its end (default on; --no-hints ignores them, as a deployment that "
        "disables hints). Live: send prompt_cache_key / prompt_cache_retention, DELETE an ended session",
    )
    r.add_argument(
        "--pin-share",
        type=float,
        default=0.5,
        help="clients' pinned bytes stay within this share of the DRAM capacity, times the share pins earn "
        "by being read (kvstore/index/pin_budget.py); a pin past it is refused and counted (default 0.5)",
    )
    r.add_argument(
        "--pin-budget-step",
        type=float,
        default=0.02,
        help="how fast clients' pins earn or lose their budget per writer's lookup, as the master's flag of "
        "that name; 0 keeps the whole --pin-share (default 0.02)",
    )
    r.add_argument(
        "--supersede",
        action="store_true",
        help="a session's new retention pin releases its previous chain (what a store could do; the "
        "serving path keeps each turn's pin until its TTL or the session's end)",
    )
    r.add_argument(
        "--sample",
        type=float,
        metavar="R",
        help="LRU curve from a sample of rate R in (0, 1] by chain root, at capacities x R (SHARDS): "
        "estimates, printed with their measured error",
    )
    r.add_argument("--sample-salt", type=int, default=0, help="--sample: hash salt (default 0)")
    r.add_argument(
        "--sample-by",
        choices=("root", "session"),
        default="root",
        help="--sample: by the first blocks of the chain (default) or by conversation / session key",
    )
    r.add_argument(
        "--sample-depth",
        type=int,
        default=1,
        help="--sample by root: blocks past the first in the root (default 1)",
    )
    add_jobs_flag(r)
    r.add_argument(
        "--ray",
        metavar="auto|ADDRESS",
        help="run the sweep's points as Ray tasks on this cluster (needs kvpool[ray]); same rows as --jobs",
    )
    r.add_argument(
        "--ray-stall-s",
        type=_positive_seconds,
        metavar="S",
        help="--ray: cancel the sweep when no point has finished for max(S, 4 x the slowest point so far) "
        "seconds (default 3600: a frozen node's task neither finishes nor fails)",
    )
    add_tier_flags(r, with_compute=True)
    r.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    r.add_argument("--out", help="write the full result (with per-request detail, for `kvpool price`) here")
    r.add_argument(
        "--out-dir", default="out/replay", help="where sweeps write CSV and PNG (default out/replay)"
    )
    r.add_argument("--model", default="default", help="live: model name to send")
    r.add_argument("--speed", type=float, default=1.0, help="live: time compression (0 = no waiting)")
    r.add_argument("--concurrency", type=int, default=256, help="live: requests in flight at most")
    r.add_argument("--vocab", type=int, help="live: synthesise tokens from hash ids with this vocabulary")
    add_progress_flags(r)
    r.set_defaults(func=cmd_replay)
