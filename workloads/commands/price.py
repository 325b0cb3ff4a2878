"""``kvpool price``: token counts or a replay result priced under caching profiles, and the provider view
(compute saved against memory held).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvpool.workloads.commands.common import (
    add_provider_flags,
    guard,
    parse_size,
    print_json,
    provider_inputs,
    tokens_arg,
)


@guard
def cmd_price(args: argparse.Namespace) -> int:
    """Price token counts or a replay result under one or all profiles; optionally the provider view."""
    from kvpool.workloads.errors import PricingError
    from kvpool.workloads.pricing import load_profiles, price, price_result

    profiles, provider_defaults = load_profiles(args.profile_file)
    names = sorted(profiles) if args.profile == "all" else [args.profile]
    for n in names:
        if n not in profiles:
            raise PricingError(f"unknown pricing profile {n!r}; choose one of {sorted(profiles)} or 'all'")
    result_obj = None
    if args.result:
        try:
            result_obj = json.loads(Path(args.result).read_text(encoding="utf-8"))
        except OSError as e:
            raise PricingError(f"{args.result}: cannot read ({e.strerror or e})") from None
        except json.JSONDecodeError as e:
            raise PricingError(f"{args.result}: not JSON ({e.msg} at line {e.lineno})") from None
    elif args.input_tokens is None:
        raise PricingError("give --input-tokens (with --cached-tokens, --output-tokens) or --result FILE")
    out: dict[str, Any] = {}
    for n in names:
        p = profiles[n]
        if result_obj is not None:
            out[n] = price_result(p, result_obj, args.write_tier)
        else:
            bill = price(
                p,
                args.input_tokens,
                args.cached_tokens,
                args.output_tokens,
                cache_write_tokens=args.cache_write_tokens,
                write_tier=args.write_tier,
                cached_token_hours=args.cached_token_hours,
            )
            out[n] = {"profile": n, **bill.to_dict()}
    payload: dict[str, Any] = out[names[0]] if len(names) == 1 else {"profiles": out}
    if args.provider:
        payload["provider"] = _provider(args, provider_defaults, result_obj)
    if args.json:
        print_json(payload)
        return 0
    print(f"{'profile':<18}{'cost $':>14}{'no-cache $':>14}{'savings $':>14}{'saved':>8}")
    for n in names:
        b = out[n]
        print(
            f"{n:<18}{b['cost_usd']:>14.6f}{b['cost_without_cache_usd']:>14.6f}{b['savings_usd']:>14.6f}"
            f"{b['savings_fraction']:>8.1%}{'  (approx.)' if b['approximate'] else ''}"
        )
    if args.provider:
        _print_provider(payload["provider"])
    return 0


def _provider(args: argparse.Namespace, d: Any, result_obj: dict[str, Any] | None) -> dict[str, Any]:
    from kvpool.workloads.errors import PricingError
    from kvpool.workloads.provider_cost import best_capacity, provider_view
    from kvpool.workloads.specs import get_spec
    from kvpool.workloads.sweep import read_csv

    inputs = provider_inputs(args, d)
    if args.sweep_csv:
        rows = read_csv(args.sweep_csv)
        spec = get_spec(rows[0]["spec"].removesuffix("-mla-only")) if rows else get_spec(args.spec)
        if args.sweep_policy:
            rows = [r for r in rows if r["policy"] == args.sweep_policy]
        return best_capacity(spec, inputs, rows, args.tier)
    spec = get_spec(args.spec)
    if result_obj is not None:
        inp, cached = int(result_obj.get("input_tokens", 0)), int(result_obj.get("cached_tokens", 0))
        cap = args.capacity_bytes or result_obj.get("capacity_bytes") or 0
        hours = args.hours if args.hours is not None else float(result_obj.get("duration_s", 0)) / 3600
    else:
        inp, cached = args.input_tokens, args.cached_tokens
        cap, hours = args.capacity_bytes or 0, args.hours if args.hours is not None else 1.0
    if isinstance(cap, str):
        cap = parse_size(cap)
    if not cap:
        raise PricingError("the provider view needs --capacity-bytes (or a result with capacity_bytes)")
    return provider_view(spec, inputs, inp, cached, int(cap), hours, args.tier)


def _print_provider(v: dict[str, Any]) -> None:
    if "best" in v:
        print("provider view over the sweep (compute spent + memory held):")
        for c in v["candidates"]:
            mark = "  <- best" if c is v["best"] or c == v["best"] else ""
            print(
                f"  {c['capacity_gb']:>10.1f} GB  compute ${c['compute_spent_usd']:>10.2f}  "
                f"memory ${c['storage_usd']:>9.2f}  total ${c['total_cost_usd']:>10.2f}{mark}"
            )
        return
    print(
        f"provider view ({v['spec']}, {v['tier']}, {v['capacity_gb']:.1f} GB for {v['hours']:.2f} h): "
        f"prefill GPU-hours saved {v['prefill_gpu_hours_saved']:.2f} = ${v['compute_saved_usd']:.2f}, "
        f"memory ${v['storage_usd']:.2f}, net ${v['net_saving_usd']:.2f}"
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``price`` to the ``kvpool`` command line."""
    from kvpool.workloads.specs import SPECS

    specs = sorted(SPECS)
    p = subparsers.add_parser("price", help="price token counts or a replay result under caching profiles")
    p.add_argument("--profile", default="moonshot-k3", help="profile name or 'all' (default moonshot-k3)")
    p.add_argument("--profile-file", help="TOML file with [profiles.NAME] tables (default: shipped profiles)")
    p.add_argument("--input-tokens", type=tokens_arg, help="prompt tokens to price")
    p.add_argument("--cached-tokens", type=tokens_arg, default=0, help="of them, served from the cache")
    p.add_argument("--output-tokens", type=tokens_arg, default=0, help="generated tokens")
    p.add_argument("--cache-write-tokens", type=tokens_arg, help="tokens written (default: uncached input)")
    p.add_argument("--write-tier", help="cache write tier of the profile, e.g. 5m or 1h")
    p.add_argument(
        "--cached-token-hours", type=float, default=0.0, help="explicit-cache storage, token-hours"
    )
    p.add_argument("--result", help="a replay result JSON (`kvpool replay --out`) instead of counts")
    p.add_argument("--provider", action="store_true", help="add the provider view (compute saved vs memory)")
    p.add_argument("--spec", choices=specs, default="k3", help="model spec of the provider view")
    p.add_argument("--capacity-bytes", help="provider: cache capacity (e.g. 2TiB)")
    p.add_argument(
        "--hours", type=float, help="provider: hours the capacity is held (default: the trace span)"
    )
    p.add_argument(
        "--tier", choices=("dram", "ssd"), default="dram", help="provider: the tier the capacity is priced as"
    )
    p.add_argument("--sweep-csv", help="provider: a sweep CSV; picks the capacity of least total cost")
    p.add_argument("--sweep-policy", help="provider: use only this policy's rows of the sweep")
    add_provider_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=cmd_price)
