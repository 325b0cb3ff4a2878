"""`kvpool` command line: one subcommand family per module, registered lazily.

Each module named in ``COMMANDS`` (command -> module) exposes ``register(subparsers)``, which adds its
subcommands and sets ``func`` on them. Keeping the table here (and the code next to the feature) lets each
feature own its CLI.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# The commands each module registers: ``kvpool CMD`` imports CMD's module only. All of them together import
# torch, FastAPI and the master's core, seconds of start-up (15-20 s wall on a loaded 2-core box) that
# ``kvpool up``, ``status`` and ``chaos`` never use. tests/test_cli_help.py keeps this table true.
COMMANDS = {
    "generate": "kvpool.model.cli",
    "store": "kvpool.kvstore.cli",
    **dict.fromkeys(("replay", "price", "provision", "report", "trace"), "kvpool.workloads.cli"),
    "prefill": "kvpool.commands.worker",
    "decode": "kvpool.commands.worker",
    "verify": "kvpool.commands.verify",
    "demo": "kvpool.commands.demo",
    "gateway": "kvpool.gateway.cli",
    "up": "kvpool.commands.up",
    "status": "kvpool.commands.status",
    "chaos": "kvpool.commands.chaos",  # faults on a --netns cluster
}
COMMAND_MODULES = tuple(dict.fromkeys(COMMANDS.values()))  # every family once, in the table's order


def build_parser(modules: Sequence[str] = COMMAND_MODULES) -> argparse.ArgumentParser:
    """The parser of every command (``modules``: only theirs)."""
    parser = argparse.ArgumentParser(prog="kvpool", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # feature not built yet; its own import errors still surface
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    module = COMMANDS.get(argv[0]) if argv else None
    parser = build_parser((module,) if module else COMMAND_MODULES)  # no or unknown command: all, for help
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
