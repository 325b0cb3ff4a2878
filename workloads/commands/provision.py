"""``kvpool provision``: the cheapest DRAM + SSD mix for a trace at a target token hit rate or TTFT."""

from __future__ import annotations

import argparse
from typing import Any

from kvpool.workloads.commands.common import (
    add_jobs_flag,
    add_progress_flags,
    add_provider_flags,
    add_tier_flags,
    guard,
    load_requests,
    parse_size,
    print_json,
    progress_factory,
    provider_inputs,
    ttft_model,
)
from kvpool.workloads.errors import ReplayError


def _dram_caps(text: str, reqs: list, spec: Any, block_size: int, points: int) -> list[int]:
    from kvpool.workloads.sweep import auto_capacities, sweep_range

    if text.strip() == "auto":
        lo, hi = sweep_range(reqs, spec, block_size)
        return [c * spec.mla_bytes_per_token * block_size for c in auto_capacities(hi, points, lo)]
    caps = [parse_size(t) for t in text.split(",") if t.strip()]
    if not caps:
        raise ReplayError("--dram takes a comma list of sizes or 'auto'")
    return caps


def _ratios(text: str) -> list[float]:
    try:
        out = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ReplayError(f"--ssd-ratios takes numbers, e.g. 0,4,16; got {text!r}") from None
    if not out or any(r < 0 or r != r for r in out):
        raise ReplayError(f"--ssd-ratios takes numbers >= 0, e.g. 0,4,16; got {text!r}")
    return out


@guard
def cmd_provision(args: argparse.Namespace) -> int:
    """Simulate a DRAM x SSD grid and print the cheapest mix meeting the target (exit 1 if none does)."""
    from kvpool.workloads.pricing import get_profile, load_profiles
    from kvpool.workloads.progress import PointProgress
    from kvpool.workloads.provision import Target, provision
    from kvpool.workloads.sim import effective_block_size
    from kvpool.workloads.specs import get_spec
    from kvpool.workloads.sweep import check_policies

    check_policies([args.policy])
    if args.policy in ("reference", "bound", "optimum"):
        raise ReplayError("provisioning simulates an online policy with an SSD tier; offline ones have none")
    target = Target(args.target_hit, args.target_ttft_ms, args.quantile)
    target.check()
    reqs = load_requests(args.trace, args.limit)
    spec = get_spec(args.spec)
    _, defaults = load_profiles(args.profile_file)
    bs = effective_block_size(reqs, spec, None)
    caps, ratios = _dram_caps(args.dram, reqs, spec, bs, args.points), _ratios(args.ssd_ratios)
    out = provision(
        reqs, spec, caps, ratios, provider_inputs(args, defaults), target, ttft_model(args), args.policy, bs,
        get_profile(args.profile, args.profile_file), PointProgress(len(caps) * len(ratios),
        args.progress is not False), progress_factory(args), args.jobs,
    )  # fmt: skip
    if args.json:
        print_json(out)
    else:
        _print(out)
    return 0 if out["best"] is not None else 1


def _print(out: dict[str, Any]) -> None:
    q = out["target"]["quantile"]
    head = (f"{'DRAM GiB':>10}{'SSD GiB':>10}{'token hit':>11}{'from SSD':>10}{'TTFT ' + q:>12}"
            f"{'compute $':>12}{'memory $':>11}{'total $':>11}{'user $':>11}  meets")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in out["rows"]:
        print(
            f"{r['dram_bytes'] / 2**30:>10.1f}{r['ssd_bytes'] / 2**30:>10.1f}{r['token_hit_rate']:>11.2%}"
            f"{r['ssd_token_hit_rate']:>10.2%}{r['ttft_ms']:>10.1f}ms{r['compute_usd']:>12.2f}"
            f"{r['memory_usd']:>11.2f}{r['total_usd']:>11.2f}{r.get('user_cost_usd', 0):>11.2f}"
            f"  {'yes' if r['meets_target'] else 'no'}"
        )
    for label, key in (("cheapest mix", "best"), ("cheapest DRAM only", "best_dram_only")):
        b = out[key]
        if b is None:
            print(f"{label}: none in the grid meets the target")
        else:
            print(
                f"{label}: DRAM {b['dram_bytes'] / 2**30:,.1f} GiB + SSD {b['ssd_bytes'] / 2**30:,.1f} GiB, "
                f"token hit {b['token_hit_rate']:.2%}, TTFT {q} {b['ttft_ms']:.1f} ms, ${b['total_usd']:.2f}"
            )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``provision`` to the ``kvpool`` command line."""
    from kvpool.workloads.specs import SPECS

    p = subparsers.add_parser(
        "provision", help="cheapest DRAM + SSD mix for a trace at a target token hit rate or TTFT"
    )
    p.add_argument("trace", help="bundled trace name (conversation, synthetic) or a JSONL file (.gz ok)")
    p.add_argument("--target-hit", type=float, help="token hit rate to reach, a fraction (e.g. 0.2)")
    p.add_argument("--target-ttft-ms", type=float, help="estimated TTFT to stay under, ms")
    p.add_argument("--quantile", default="p90", help="TTFT quantile the target applies to: p50 p90 p99 mean")
    p.add_argument("--dram", default="auto", help="DRAM capacities: a comma list (64GiB,256GiB) or 'auto'")
    p.add_argument("--points", type=int, default=6, help="DRAM capacities of an 'auto' grid")
    p.add_argument(
        "--ssd-ratios", default="0,4,16", help="SSD capacity as multiples of DRAM (default 0,4,16)"
    )
    p.add_argument("--policy", default="hybrid", help="online eviction policy (default hybrid)")
    p.add_argument(
        "--spec", choices=sorted(SPECS), default="k3", help="model spec for byte sizes and FLOPs (default k3)"
    )
    p.add_argument("--limit", type=int, help="first N requests (by arrival)")
    p.add_argument("--profile", default="moonshot-k3", help="user price profile for the user-cost column")
    p.add_argument("--profile-file", help="TOML file with [profiles.NAME] and [provider] tables")
    add_provider_flags(p)
    add_tier_flags(p, with_compute=False)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_jobs_flag(p)
    add_progress_flags(p)
    p.set_defaults(func=cmd_provision)
