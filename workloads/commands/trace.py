"""``kvpool trace convert | generate | stats``: trace tools."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvpool.workloads.commands.common import guard, load_requests, print_json
from kvpool.workloads.errors import ReplayError


@guard
def cmd_trace_convert(args: argparse.Namespace) -> int:
    """Convert between Mooncake JSONL, kvpool JSONL and kvpool Parquet (columnar)."""
    from kvpool.workloads.synthetic_tokens import with_synthetic_tokens
    from kvpool.workloads.trace import read_trace, resolve_trace
    from kvpool.workloads.trace_columnar import write_parquet
    from kvpool.workloads.trace_write import write_kvpool, write_mooncake

    to = args.to or ("parquet" if str(args.output).endswith(".parquet") else None)
    if to is None:
        raise ReplayError("give --to parquet|kvpool|mooncake (an OUT ending in .parquet says parquet)")
    reqs = read_trace(resolve_trace(args.input))
    if to == "mooncake":
        n = write_mooncake(reqs, args.output, args.block_size)
    else:
        if args.synth_tokens:
            if not args.vocab:
                raise ReplayError("--synth-tokens needs --vocab V")
            reqs = list(with_synthetic_tokens(reqs, args.vocab, args.seed))
        n = write_parquet(reqs, args.output) if to == "parquet" else write_kvpool(reqs, args.output)
    print(f"wrote {n} records to {args.output} ({to})", file=sys.stderr)
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


@guard
def cmd_trace_generate(args: argparse.Namespace) -> int:
    """Generate a synthetic workload as kvpool JSONL."""
    from kvpool.workloads.errors import GeneratorParamError
    from kvpool.workloads.generators import generate, generate_mix, parse_mix
    from kvpool.workloads.trace import read_trace, resolve_trace
    from kvpool.workloads.trace_write import write_kvpool
    from kvpool.workloads.workload_params import make_params

    overrides = _params(args.param)
    if args.workload == "mix":
        mix = parse_mix(args.mix or "chat,agent,coding,rag,oneshot")
        unknown = set(overrides) - set(mix)
        if unknown:
            raise GeneratorParamError(f"--param for workloads not in the mix: {sorted(unknown)}")
        params = {w: make_params(w, overrides.get(w)) for w in mix}
        if args.arrivals_from:
            raise GeneratorParamError("--arrivals-from applies to a single workload, not a mix")
        reqs = generate_mix(
            mix, args.requests, args.rate, args.seed, args.vocab, params, args.tenants, hints=args.hints
        )
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
            args.workload,
            args.requests,
            args.rate,
            args.seed,
            args.vocab,
            params,
            args.tenants,
            arrivals,
            hints=args.hints,
        )
    n = write_kvpool(reqs, args.output)
    print(f"wrote {n} requests to {args.output}", file=sys.stderr)
    return 0


@guard
def cmd_trace_stats(args: argparse.Namespace) -> int:
    """Sizes, span and infinite-cache hit rate of a trace."""
    from kvpool.workloads.stats import trace_stats

    s = trace_stats(load_requests(args.trace, args.limit), args.block_size)
    if args.json:
        print_json(s)
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


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``trace`` to the ``kvpool`` command line."""
    from kvpool.workloads.workload_params import PARAMS

    t = subparsers.add_parser("trace", help="trace tools: convert, generate, stats")
    tsub = t.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    c = tsub.add_parser(
        "convert", help="Mooncake JSONL <-> kvpool JSONL <-> Parquet (docs/design/workloads.md: losses)"
    )
    c.add_argument("input", help="a trace in any form (bundled name, JSONL, .gz, Parquet)")
    c.add_argument("output")
    c.add_argument(
        "--to",
        choices=("parquet", "kvpool", "mooncake"),
        help="output format (default: parquet when OUT ends in .parquet); parquet is columnar kvpool",
    )
    c.add_argument("--block-size", type=int, default=512, help="mooncake: tokens per hash id")
    c.add_argument("--synth-tokens", action="store_true", help="kvpool: fill tokens from hash ids")
    c.add_argument("--vocab", type=int, help="vocabulary for --synth-tokens")
    c.add_argument("--seed", type=int, default=0, help="seed of synthesised tokens")
    c.set_defaults(func=cmd_trace_convert)
    g = tsub.add_parser("generate", help="synthetic workload as kvpool JSONL with token ids")
    g.add_argument(
        "--workload", choices=[*sorted(PARAMS), "mix"], required=True, help="workload to generate (or mix)"
    )
    g.add_argument("--mix", help="for --workload mix: e.g. chat=0.4,agent=0.2,coding=0.2,rag=0.1,oneshot=0.1")
    g.add_argument("--requests", type=int, default=1000, help="number of requests")
    g.add_argument("--rate", type=float, default=2.0, help="mean requests per second")
    g.add_argument("--seed", type=int, default=0, help="random seed (same seed, same trace)")
    g.add_argument("--vocab", type=int, default=32_000, help="token ids in [0, V) (the tiny model has 1024)")
    g.add_argument("--tenants", type=int, default=1, help="tenants the requests are spread over")
    g.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="WORKLOAD.NAME=VALUE",
        help="override a generator parameter, e.g. chat.turns=8 (repeatable)",
    )
    g.add_argument("--arrivals-from", help="take arrival times from this trace instead of Poisson")
    g.add_argument(
        "--hints",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="client retention hints on each record (session key, 5m/1h tiers, session end; default on)",
    )
    g.add_argument("-o", "--output", required=True, help="file to write (.gz compresses)")
    g.set_defaults(func=cmd_trace_generate)
    s = tsub.add_parser("stats", help="sizes, span and infinite-cache hit rate")
    s.add_argument("trace")
    s.add_argument("--block-size", type=int, default=512, help="tokens per block for token records")
    s.add_argument("--limit", type=int, help="first N requests only")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    s.set_defaults(func=cmd_trace_stats)
