"""``kvpool replay | price | report | trace {convert,generate,stats}``: the workloads command line.

Handlers are thin: parse, call the library, print. Every bad input raises a ``WorkloadError`` subclass
that :func:`_guard` turns into ``kvpool <cmd>: error: <message>`` on stderr and exit code 2.

Why one module of ~650 lines: it is only argument parsing and printing for the workload commands
(replay, price, report, trace), each a thin call into the modules that do the work.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvpool.workloads.errors import ReplayError, WorkloadError

EXIT_BAD_INPUT = 2
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgtp]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "p": 10**15,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
    "pi": 2**50,
}


def parse_size(text: str) -> int:
    """``"512GiB"``, ``"1.5TB"``, ``"4e9"`` -> bytes (int, > 0)."""
    m = _SIZE.match(text)
    if not m:
        raise ReplayError(f"not a size: {text!r} (examples: 4e9, 512GiB, 1.5TB)")
    unit = (m.group(2) or "").lower().removesuffix("b")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ReplayError(f"size must be > 0: {text!r}")
    return value


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except WorkloadError as e:
            print(f"kvpool {args.command}: error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except BrokenPipeError:  # output piped into `head`: stop quietly, as other CLI tools do
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1

    run.__doc__ = fn.__doc__
    return run


def _print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=None, separators=(", ", ": "), default=str)
    sys.stdout.write("\n")


def _load(trace: str, limit: int | None) -> list:
    from kvpool.workloads.trace import read_trace, resolve_trace

    path = resolve_trace(trace)
    reqs = read_trace(path, workload=trace if trace in ("conversation", "synthetic") else None)
    if limit is not None:
        if limit <= 0:
            raise ReplayError("--limit must be > 0")
        reqs = sorted(reqs, key=lambda r: r.arrival_ms)[:limit]
    if not reqs:
        raise ReplayError(f"{trace}: no requests")
    return reqs


def _progress(args: argparse.Namespace) -> Callable[[str], Any]:
    from kvpool.workloads.progress import Progress

    enabled = None if args.progress is None else args.progress
    return lambda label: Progress(label, enabled)


# --------------------------------------------------------------------------------------------- replay


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


@_guard
def cmd_replay(args: argparse.Namespace) -> int:
    """Replay a trace, simulated (default) or live."""
    from kvpool.workloads.trace import with_synthetic_tokens

    if args.live and args.sim:
        raise ReplayError("choose --sim or --live, not both")
    reqs = _load(args.trace, args.limit)
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
            progress=_progress(args)("live"),
        )
        if args.out:
            Path(args.out).write_text(json.dumps(summary) + "\n", encoding="utf-8")
        summary.pop("per_request", None)
        _print_json(summary) if args.json else _print_live_table(summary)
        return 0 if summary["errors"] == 0 else 1
    return _replay_sim(args, reqs)


def _replay_sim(args: argparse.Namespace, reqs: list) -> int:
    from kvpool.workloads.sim import CheckpointPolicy, SimConfig, effective_block_size, simulate
    from kvpool.workloads.specs import get_spec
    from kvpool.workloads.sweep import capacity_sweep, checkpoint_sweep, plot_rows, write_csv

    spec = get_spec(args.spec, pure_mla=args.pure_mla)
    bs = effective_block_size(reqs, spec, args.block_size)
    if args.capacity_blocks is not None and args.capacity_bytes is not None:
        raise ReplayError("give --capacity-blocks or --capacity-bytes, not both")
    unit = "blocks" if args.capacity_blocks is not None else "bytes"
    caps = _capacities(
        args.capacity_blocks if unit == "blocks" else args.capacity_bytes, unit, reqs, spec, bs
    )
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    ck = CheckpointPolicy.parse(args.checkpoints)
    progress = _progress(args)
    sweep = args.checkpoint_sweep is not None or len(policies) > 1 or (caps is not None and len(caps) > 1)
    if sweep:
        if caps is None:
            raise ReplayError(
                "a sweep needs capacities: --capacity-blocks or --capacity-bytes (a list or 'auto')"
            )
        out_dir = Path(args.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if args.checkpoint_sweep is not None:
            cks = [CheckpointPolicy.parse(t) for t in args.checkpoint_sweep.split(";") if t.strip()]
            rows = checkpoint_sweep(reqs, spec, caps, unit, policies[0], cks, bs, progress)
            group, name = "checkpoints", "checkpoint_sweep"
        else:
            rows = capacity_sweep(reqs, spec, caps, unit, policies, ck, bs, progress)
            group, name = "policy", "policy_sweep"
        write_csv(rows, out_dir / f"{name}.csv")
        metric = "token_hit_rate"
        plot_rows(
            rows, out_dir / f"{name}.png", group, metric, f"{args.trace}: {metric} vs capacity ({spec.name})"
        )
        if args.json:
            _print_json(
                {"rows": rows, "csv": str(out_dir / f"{name}.csv"), "png": str(out_dir / f"{name}.png")}
            )
        else:
            _print_rows(rows, group)
            print(f"wrote {out_dir / (name + '.csv')} and {out_dir / (name + '.png')}")
        return 0
    if policies == ["optimum"]:
        raise ReplayError("the offline optimum runs in a sweep: add another --policy or a capacity list")
    cfg = SimConfig(
        spec=spec,
        policy=policies[0],
        capacity=caps[0] if caps else None,
        capacity_unit=unit,
        block_size=bs,
        checkpoints=ck,
        high_watermark=args.high_watermark,
        low_watermark=args.low_watermark,
        store_output=not args.no_output_blocks,
        visibility_delay_ms=args.visibility_delay_ms,
    )
    result = simulate(reqs, cfg, progress(f"replay {args.trace}"))
    if args.out:
        Path(args.out).write_text(json.dumps(result.to_dict(per_request=True)) + "\n", encoding="utf-8")
    if args.json:
        _print_json(result.to_dict())
    else:
        _print_sim_table(result.to_dict())
    return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _print_sim_table(d: dict[str, Any]) -> None:
    cfg = d["config"]
    cap = "unbounded" if cfg["capacity"] is None else f"{cfg['capacity']} {cfg['capacity_unit']}"
    print(
        f"spec {cfg['spec']}  policy {cfg['policy']}  capacity {cap}  block {cfg['block_size']}  "
        f"checkpoints {cfg['checkpoints'] if cfg['hybrid'] else 'n/a (pure MLA)'}"
    )
    head = (
        f"{'workload':<14}{'requests':>9}{'block hit':>11}{'token hit':>11}{'MLA hit':>9}{'lost':>8}"
        f"{'MLA written':>14}{'KDA written':>14}{'evicted':>14}"
    )
    print(head)
    print("-" * len(head))
    rows = [*d["workloads"].items(), ("ALL", d)]
    for name, w in rows:
        print(
            f"{name:<14}{w['requests']:>9}{w['block_hit_rate']:>11.2%}{w['token_hit_rate']:>11.2%}"
            f"{w['mla_token_hit_rate']:>9.2%}{w['lost_token_fraction']:>8.2%}"
            f"{_fmt_bytes(w['mla_bytes_written']):>14}{_fmt_bytes(w['kda_bytes_written']):>14}"
            f"{_fmt_bytes(w['bytes_evicted']):>14}"
        )
    print(
        f"evicted {d['objects_evicted']} objects / {_fmt_bytes(d['bytes_evicted'])}; "
        f"held at end {_fmt_bytes(d['bytes_held'])}"
    )


def _print_rows(rows: Sequence[dict[str, Any]], group: str) -> None:
    head = f"{group:<28}{'capacity':>14}{'GiB':>10}{'block hit':>11}{'token hit':>11}{'lost':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r[group]:<28}{r['capacity']!s:>14}{float(r['capacity_bytes']) / 2**30:>10.1f}"
            f"{float(r['block_hit_rate']):>11.2%}{float(r['token_hit_rate']):>11.2%}"
            f"{float(r['lost_token_fraction'] or 0):>8.2%}"
        )


def _print_live_table(s: dict[str, Any]) -> None:
    print(
        f"{'workload':<14}{'requests':>9}{'errors':>8}{'token hit':>11}{'TTFT p50':>10}{'p90':>9}{'p99':>9}"
    )
    for name, w in [*s["workloads"].items(), ("ALL", s)]:
        print(
            f"{name:<14}{w['requests']:>9}{w['errors']:>8}{w['token_hit_rate']:>11.2%}"
            f"{w['ttft_ms_p50']:>10.1f}{w['ttft_ms_p90']:>9.1f}{w['ttft_ms_p99']:>9.1f}"
        )
    for err in s["first_errors"]:
        print(f"error: {err}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------- price


def _tokens_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    return value  # sign checked by pricing, so the message names the field


@_guard
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
        _print_json(payload)
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
    from kvpool.workloads.pricing import ProviderInputs, best_capacity, provider_view
    from kvpool.workloads.specs import get_spec
    from kvpool.workloads.sweep import read_csv

    inputs = ProviderInputs(
        gpu_hour_usd=d.gpu_hour_usd if args.gpu_hour_usd is None else args.gpu_hour_usd,
        gpu_flops=d.gpu_flops if args.gpu_flops is None else args.gpu_flops,
        mfu=d.mfu if args.mfu is None else args.mfu,
        dram_gb_hour_usd=d.dram_gb_hour_usd if args.dram_gb_hour_usd is None else args.dram_gb_hour_usd,
        ssd_gb_hour_usd=d.ssd_gb_hour_usd if args.ssd_gb_hour_usd is None else args.ssd_gb_hour_usd,
    )
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


# --------------------------------------------------------------------------------------------- report


@_guard
def cmd_report(args: argparse.Namespace) -> int:
    """Run sweeps and pricing on traces and write one self-contained HTML page."""
    from kvpool.workloads.report import build_report

    path = build_report(
        traces=args.trace or ["conversation", "synthetic"],
        out=Path(args.out),
        spec_name=args.spec,
        limit=args.limit,
        points=args.points,
        policies=[p.strip() for p in args.policies.split(",") if p.strip()],
        profile_file=args.profile_file,
        progress=_progress(args),
    )
    print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------------------------------------- trace


@_guard
def cmd_trace_convert(args: argparse.Namespace) -> int:
    """Convert between Mooncake and kvpool JSONL."""
    from kvpool.workloads.trace import (
        read_trace,
        resolve_trace,
        with_synthetic_tokens,
        write_kvpool,
        write_mooncake,
    )

    reqs = read_trace(resolve_trace(args.input))
    if args.to == "mooncake":
        n = write_mooncake(reqs, args.output, args.block_size)
    else:
        if args.synth_tokens:
            if not args.vocab:
                raise ReplayError("--synth-tokens needs --vocab V")
            reqs = list(with_synthetic_tokens(reqs, args.vocab, args.seed))
        n = write_kvpool(reqs, args.output)
    print(f"wrote {n} records to {args.output} ({args.to})", file=sys.stderr)
    return 0


def _params(pairs: Sequence[str]) -> dict[str, dict[str, str]]:
    from kvpool.workloads.errors import GeneratorParamError

    out: dict[str, dict[str, str]] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        wl, dot, name = key.partition(".")
        if not sep or not dot:
            raise GeneratorParamError(f"--param takes WORKLOAD.NAME=VALUE, got {pair!r}")
        out.setdefault(wl, {})[name] = value
    return out


@_guard
def cmd_trace_generate(args: argparse.Namespace) -> int:
    """Generate a synthetic workload as kvpool JSONL."""
    from kvpool.workloads.errors import GeneratorParamError
    from kvpool.workloads.generators import generate, generate_mix, make_params, parse_mix
    from kvpool.workloads.trace import read_trace, resolve_trace, write_kvpool

    overrides = _params(args.param)
    if args.workload == "mix":
        mix = parse_mix(args.mix or "chat,agent,coding,rag,oneshot")
        unknown = set(overrides) - set(mix)
        if unknown:
            raise GeneratorParamError(f"--param for workloads not in the mix: {sorted(unknown)}")
        params = {w: make_params(w, overrides.get(w)) for w in mix}
        if args.arrivals_from:
            raise GeneratorParamError("--arrivals-from applies to a single workload, not a mix")
        reqs = generate_mix(mix, args.requests, args.rate, args.seed, args.vocab, params, args.tenants)
    else:
        if set(overrides) - {args.workload}:
            raise GeneratorParamError(
                f"--param for another workload than {args.workload}: {sorted(overrides)}"
            )
        params = make_params(args.workload, overrides.get(args.workload))
        arrivals = None
        if args.arrivals_from:
            arrivals = [r.arrival_ms for r in read_trace(resolve_trace(args.arrivals_from))]
        reqs = generate(
            args.workload, args.requests, args.rate, args.seed, args.vocab, params, args.tenants, arrivals
        )
    n = write_kvpool(reqs, args.output)
    print(f"wrote {n} requests to {args.output}", file=sys.stderr)
    return 0


@_guard
def cmd_trace_stats(args: argparse.Namespace) -> int:
    """Sizes, span and infinite-cache hit rate of a trace."""
    from kvpool.workloads.stats import trace_stats

    s = trace_stats(_load(args.trace, args.limit), args.block_size)
    if args.json:
        _print_json(s)
        return 0
    print(
        f"{'workload':<14}{'requests':>9}{'mean in':>10}{'mean out':>10}{'blocks':>10}{'span s':>9}"
        f"{'inf. block hit':>16}{'inf. token hit':>16}"
    )
    for name, w in [*s["workloads"].items(), ("ALL", s)]:
        print(
            f"{name:<14}{w['requests']:>9}{w['mean_input']:>10.1f}{w['mean_output']:>10.1f}{w['blocks']:>10}"
            f"{w['duration_s']:>9.0f}{w['infinite_block_hit_rate']:>16.2%}{w['infinite_token_hit_rate']:>16.2%}"
        )
    print(f"unique blocks: {s['unique_blocks']}")
    return 0


# ------------------------------------------------------------------------------------------- register


def _progress_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--progress", dest="progress", action="store_true", default=None, help="force the progress bar"
    )
    g.add_argument("--no-progress", dest="progress", action="store_false", help="never draw the progress bar")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``replay``, ``price``, ``report`` and ``trace`` to the ``kvpool`` command line."""
    from kvpool.workloads.generators import PARAMS
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
    r.add_argument("--capacity-blocks", help="capacity in MLA blocks (a comma list or 'auto' sweeps)")
    r.add_argument(
        "--policy", default="lru", help="eviction policy, or a comma list (add 'optimum') to sweep"
    )
    r.add_argument(
        "--checkpoints",
        default="prompt,output,junction",
        help="checkpoint policy: any of prompt,output,junction,every=N or none",
    )
    r.add_argument(
        "--checkpoint-sweep", metavar="P1;P2;...", help="compare checkpoint policies (';'-separated)"
    )
    r.add_argument("--high-watermark", type=float, default=0.95)
    r.add_argument("--low-watermark", type=float, default=0.85)
    r.add_argument("--no-output-blocks", action="store_true", help="do not store blocks closed by replies")
    r.add_argument(
        "--visibility-delay-ms",
        type=float,
        default=0.0,
        help="a request's objects become visible this long after its arrival (prefill + decode time)",
    )
    r.add_argument("--limit", type=int, help="replay only the first N requests (by arrival)")
    r.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    r.add_argument("--out", help="write the full result (with per-request detail, for `kvpool price`) here")
    r.add_argument(
        "--out-dir", default="out/replay", help="where sweeps write CSV and PNG (default out/replay)"
    )
    r.add_argument("--model", default="default", help="live: model name to send")
    r.add_argument("--speed", type=float, default=1.0, help="live: time compression (0 = no waiting)")
    r.add_argument("--concurrency", type=int, default=256, help="live: requests in flight at most")
    r.add_argument("--vocab", type=int, help="live: synthesise tokens from hash ids with this vocabulary")
    _progress_flags(r)
    r.set_defaults(func=cmd_replay)

    p = subparsers.add_parser("price", help="price token counts or a replay result under caching profiles")
    p.add_argument("--profile", default="moonshot-k3", help="profile name or 'all' (default moonshot-k3)")
    p.add_argument("--profile-file", help="TOML file with [profiles.NAME] tables (default: shipped profiles)")
    p.add_argument("--input-tokens", type=_tokens_arg)
    p.add_argument("--cached-tokens", type=_tokens_arg, default=0)
    p.add_argument("--output-tokens", type=_tokens_arg, default=0)
    p.add_argument("--cache-write-tokens", type=_tokens_arg, help="tokens written (default: uncached input)")
    p.add_argument("--write-tier", help="cache write tier of the profile, e.g. 5m or 1h")
    p.add_argument(
        "--cached-token-hours", type=float, default=0.0, help="explicit-cache storage, token-hours"
    )
    p.add_argument("--result", help="a replay result JSON (`kvpool replay --out`) instead of counts")
    p.add_argument("--provider", action="store_true", help="add the provider view (compute saved vs memory)")
    p.add_argument("--spec", choices=specs, default="k3")
    p.add_argument("--capacity-bytes", help="provider: cache capacity (e.g. 2TiB)")
    p.add_argument(
        "--hours", type=float, help="provider: hours the capacity is held (default: the trace span)"
    )
    p.add_argument("--tier", choices=("dram", "ssd"), default="dram")
    p.add_argument("--sweep-csv", help="provider: a sweep CSV; picks the capacity of least total cost")
    p.add_argument("--sweep-policy", help="provider: use only this policy's rows of the sweep")
    for name in ("gpu-hour-usd", "gpu-flops", "mfu", "dram-gb-hour-usd", "ssd-gb-hour-usd"):
        p.add_argument(f"--{name}", type=float, help="provider assumption (default from the profile file)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_price)

    rep = subparsers.add_parser("report", help="sweeps + pricing on traces -> one self-contained HTML page")
    rep.add_argument("--trace", action="append", help="trace to include (repeatable; default both bundled)")
    rep.add_argument("--out", default="out/report/report.html")
    rep.add_argument("--spec", choices=specs, default="k3")
    rep.add_argument("--limit", type=int, help="first N requests of each trace (quicker)")
    rep.add_argument("--points", type=int, default=6, help="capacities per sweep")
    rep.add_argument("--policies", default="lru,lfu,cost,optimum")
    rep.add_argument("--profile-file")
    _progress_flags(rep)
    rep.set_defaults(func=cmd_report)

    t = subparsers.add_parser("trace", help="trace tools: convert, generate, stats")
    tsub = t.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    c = tsub.add_parser("convert", help="Mooncake <-> kvpool JSONL (see docs/design/workloads.md for losses)")
    c.add_argument("input")
    c.add_argument("output")
    c.add_argument("--to", choices=("kvpool", "mooncake"), required=True)
    c.add_argument("--block-size", type=int, default=512, help="mooncake: tokens per hash id")
    c.add_argument("--synth-tokens", action="store_true", help="kvpool: fill tokens from hash ids")
    c.add_argument("--vocab", type=int, help="vocabulary for --synth-tokens")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=cmd_trace_convert)
    g = tsub.add_parser("generate", help="synthetic workload as kvpool JSONL with token ids")
    g.add_argument("--workload", choices=[*sorted(PARAMS), "mix"], required=True)
    g.add_argument("--mix", help="for --workload mix: e.g. chat=0.4,agent=0.2,coding=0.2,rag=0.1,oneshot=0.1")
    g.add_argument("--requests", type=int, default=1000)
    g.add_argument("--rate", type=float, default=2.0, help="mean requests per second")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--vocab", type=int, default=32_000, help="token ids in [0, V) (the tiny model has 1024)")
    g.add_argument("--tenants", type=int, default=1)
    g.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="WORKLOAD.NAME=VALUE",
        help="override a generator parameter, e.g. chat.turns=8 (repeatable)",
    )
    g.add_argument("--arrivals-from", help="take arrival times from this trace instead of Poisson")
    g.add_argument("-o", "--output", required=True)
    g.set_defaults(func=cmd_trace_generate)
    s = tsub.add_parser("stats", help="sizes, span and infinite-cache hit rate")
    s.add_argument("trace")
    s.add_argument("--block-size", type=int, default=512)
    s.add_argument("--limit", type=int)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_trace_stats)
