"""Every option of every ``kvpool`` command says what it does in ``--help``."""

from __future__ import annotations

import argparse

from kvpool.commands.main import build_parser


def _undocumented(parser: argparse.ArgumentParser, path: str) -> list[str]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _undocumented(sub, f"{path} {name}")
        elif action.option_strings and action.dest != "help" and not action.help:
            out.append(f"{path} {action.option_strings[-1]}")
    return out


def test_every_option_has_help_text() -> None:
    assert _undocumented(build_parser(), "kvpool") == []
