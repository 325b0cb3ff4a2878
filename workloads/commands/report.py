"""``kvpool report``: capacity sweeps and pricing on traces, rendered as one self-contained HTML page."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvpool.workloads.commands.common import add_jobs_flag, add_progress_flags, guard, progress_factory


@guard
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
        progress=progress_factory(args),
        show_points=args.progress is not False,
        jobs=args.jobs,
    )
    print(f"wrote {path}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``report`` to the ``kvpool`` command line."""
    from kvpool.workloads.specs import SPECS

    specs = sorted(SPECS)
    rep = subparsers.add_parser("report", help="sweeps + pricing on traces -> one self-contained HTML page")
    rep.add_argument("--trace", action="append", help="trace to include (repeatable; default both bundled)")
    rep.add_argument(
        "--out", default="out/report/report.html", help="HTML page to write (CSV and PNG files go beside it)"
    )
    rep.add_argument(
        "--spec", choices=specs, default="k3", help="model spec for byte sizes and FLOPs (default k3)"
    )
    rep.add_argument("--limit", type=int, help="first N requests of each trace (quicker)")
    rep.add_argument("--points", type=int, default=6, help="capacities per sweep")
    rep.add_argument(
        "--policies", default="hybrid,lru,reference,bound", help="eviction policies to sweep, comma-separated"
    )
    rep.add_argument(
        "--profile-file",
        help="TOML file with [profiles.NAME] and [provider] tables (default: shipped profiles)",
    )
    add_jobs_flag(rep)
    add_progress_flags(rep)
    rep.set_defaults(func=cmd_report)
