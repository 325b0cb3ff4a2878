"""Every option of every ``kvpool`` command says what it does in ``--help``."""

from __future__ import annotations

import argparse
import traceback

import pytest

from kvpool.commands.main import build_parser


def test_every_option_has_help_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each argparse action is seen as it is made (argument groups and subcommands included), and an option
    without help is reported with the source line that added it."""
    undocumented: list[str] = []
    init = argparse.Action.__init__

    def seen(self: argparse.Action, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        if self.option_strings and self.dest != "help" and not self.help:
            caller = next(
                f for f in reversed(traceback.extract_stack()[:-1]) if not f.filename.endswith("argparse.py")
            )
            undocumented.append(f"{self.option_strings[-1]} ({caller.filename}:{caller.lineno})")

    monkeypatch.setattr(argparse.Action, "__init__", seen)
    build_parser()
    assert undocumented == []


def test_each_command_is_found_in_the_module_that_registers_it() -> None:
    """``kvpool CMD`` builds its parser from ``COMMANDS[CMD]`` alone: the table names every command, each
    with the module whose ``register`` adds it."""
    import importlib

    from kvpool.commands.main import COMMAND_MODULES, COMMANDS

    found = {}
    for name in COMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(name).register(sub)
        found.update(dict.fromkeys(sub.choices, name))
    assert found == COMMANDS
