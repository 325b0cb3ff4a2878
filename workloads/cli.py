"""``kvpool replay | price | provision | report | trace {convert,generate,stats}``: workloads commands.

Handlers are thin: parse, call the library, print. Each command lives in ``kvpool.workloads.commands``;
every bad input raises a ``WorkloadError`` subclass that ``commands.common.guard`` turns into
``kvpool <cmd>: error: <message>`` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse

from kvpool.workloads.commands import price, provision, replay, report, trace


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``replay``, ``price``, ``provision``, ``report`` and ``trace`` to the ``kvpool`` command line."""
    for command in (replay, price, provision, report, trace):
        command.add_parser(subparsers)
