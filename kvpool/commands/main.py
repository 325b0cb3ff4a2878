"""`kvpool` command line: one subcommand family per module, registered lazily.

Each module in ``COMMAND_MODULES`` exposes ``register(subparsers)``, which adds its subcommands and sets
``func`` on them. Keeping the table here (and the code next to the feature) lets each feature own its CLI.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMAND_MODULES = (
    "kvpool.model.cli",  # generate
    "kvpool.kvstore.cli",  # store master|node|...
    "kvpool.workloads.cli",  # replay, price, provision, report, trace
    "kvpool.commands.worker",  # prefill, decode (workers)
    "kvpool.commands.verify",  # verify
    "kvpool.commands.demo",  # demo
    "kvpool.gateway.cli",  # gateway
    "kvpool.commands.up",  # up
    "kvpool.commands.status",  # status
    "kvpool.commands.chaos",  # chaos (faults on a --netns cluster)
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # feature not built yet; its own import errors still surface
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
