"""``kvpool verify`` on the command line: flags, the exclusive ways to name what is verified (an endpoint,
given workers, or a local cluster started here and stopped after), the table or one JSON object, and the
exit status (0 only when every check passed). The checks themselves are ``kvpool.verify``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict

from kvpool.verify import Report, run_verify, run_verify_endpoint


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "verify", help="check disaggregated + cache == plain model on a fixed prompt set"
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="tiny | tiny8 | tiny-dsa | tiny-dsa-fp8 | a Kimi-Linear checkpoint directory",
    )
    p.add_argument(
        "--endpoint", default=None, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1"
    )
    p.add_argument("--api-key", default=None, help="bearer key for --endpoint")
    p.add_argument(
        "--prefill", default=None, help="prefill worker HOST:PORT (default: start a local cluster)"
    )
    p.add_argument("--decode", default=None, help="decode worker HOST:PORT (with --prefill)")
    p.add_argument(
        "--block-size", type=int, default=64, help="tokens per cache block of the cluster under test"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads here and in the workers (must match)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


def print_table(report: Report) -> None:
    """One line per case, then the verdict line (what a user reads when no ``--json`` is asked)."""
    print(f"{'case':<14}{'prompt':>7}{'cached':>7}  {'tokens':<10}{'logits':<9}{'max diff':>10}  resume")
    for r in report.rows:
        same = "identical" if r.identical else "DIFFERENT"
        bits = "n/a" if r.bitwise_logits is None else "bitwise" if r.bitwise_logits else "close"
        diff = "n/a" if r.max_logit_diff is None else f"{r.max_logit_diff:.2e}"
        print(
            f"{r.name:<14}{r.prompt_tokens:>7}{r.cached_tokens:>7}  {same:<10}{bits:<9}"
            f"{diff:>10}  {r.resume_path}{'' if r.cached_verified else '  CACHED MISMATCH'}"
        )
    diff = "n/a" if report.max_logit_diff is None else f"{report.max_logit_diff:.2e}"
    bitwise = (
        "first-token logits not compared (an endpoint returns tokens only)"
        if report.bitwise_first_logits is None
        else f"{report.bitwise_first_logits} bitwise first-token logits"
    )
    print(
        f"{report.identical}/{report.requests} identical greedy continuations "
        f"({report.identical_fraction:.0%}), {bitwise}, "
        f"max first-token logit diff {diff}, cached {report.cached_tokens}/"
        f"{report.prompt_tokens} prompt tokens "
        f"({'verified' if report.cached_tokens_verified else 'MISMATCH'}) "
        f"in {report.elapsed_s:.1f}s: {'OK' if report.ok else 'FAIL'}"
    )


def run(args: argparse.Namespace) -> int:
    if args.endpoint and args.prefill:
        print("kvpool verify: --endpoint and --prefill/--decode are exclusive", file=sys.stderr)
        return 2
    if (args.prefill is None) != (args.decode is None):
        print("kvpool verify: give both --prefill and --decode, or neither", file=sys.stderr)
        return 2
    cluster = None
    if args.endpoint:
        import httpx

        from kvpool.decode.endpoint_client import EndpointError

        try:
            report = asyncio.run(
                run_verify_endpoint(
                    args.endpoint, args.model, args.block_size, threads=args.threads, api_key=args.api_key
                )
            )
        except (EndpointError, httpx.HTTPError, OSError) as exc:
            print(f"kvpool verify: {args.endpoint}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        return _emit(report, args.json)
    if args.prefill is None:
        from kvpool.launch.cluster import Cluster
        from kvpool.launch.config import load_config
        from kvpool.runtime.spawn import LaunchError

        # the workers run the reference's model, block size and torch threads (bitwise comparisons need the
        # same kernels); the checks use one prefill worker
        cluster_flags = {"model": args.model, "block_size": args.block_size, "threads": args.threads}
        config = load_config(overrides={"cluster": cluster_flags, "prefill": {"count": 1}})
        try:
            # no gateway (the checks call the workers' gRPC), no secret (this process holds none), and a
            # `kvpool up` already running stays the one `kvpool status` shows
            cluster = Cluster(config, gateway=False, auth=False, publish=False).start()
        except LaunchError as exc:
            print(f"kvpool verify: {exc}", file=sys.stderr)
            return 1
        prefill, decode = cluster.address("prefill-0"), cluster.address("decode-0")
    else:
        prefill, decode = args.prefill, args.decode
    try:
        report = asyncio.run(run_verify(args.model, prefill, decode, args.block_size, threads=args.threads))
    finally:
        if cluster is not None:
            cluster.stop()
    return _emit(report, args.json)


def _emit(report: Report, as_json: bool) -> int:
    if as_json:
        out = asdict(report)
        out["rows"] = [asdict(r) for r in report.rows]
        out["ok"] = report.ok
        print(json.dumps(out))
    else:
        print_table(report)
    return 0 if report.ok else 1
