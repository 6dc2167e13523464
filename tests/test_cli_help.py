"""Every ``kvgate <command> --help`` (sub-commands included) reads as plain text: each option
says what it is for, no RST markup or Python repr leaks in, and ``--version`` answers."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from kvgate.router import cli

REPR = re.compile(r"<[A-Za-z_.]+: [^>]*>|``")


def parsers(command: str, monkeypatch: pytest.MonkeyPatch) -> list[argparse.ArgumentParser]:
    """The parser ``kvgate <command> --help`` prints, caught as it prints."""
    seen: list[argparse.ArgumentParser] = []

    def record(self: argparse.ArgumentParser, file: object = None) -> None:
        seen.append(self)

    monkeypatch.setattr(argparse.ArgumentParser, "print_help", record)
    with pytest.raises(SystemExit) as stop:
        cli.main([command, "--help"])
    assert stop.value.code in (0, None)
    assert seen, command
    return seen


def with_subcommands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from with_subcommands(child)


@pytest.mark.parametrize("command", sorted(cli.SUBCOMMANDS))
def test_every_option_has_plain_help(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for top in parsers(command, monkeypatch):
        for parser in with_subcommands(top):
            text = parser.format_help()
            assert not REPR.search(text), (parser.prog, REPR.search(text))
            for action in parser._actions:
                if action.option_strings and action.help != argparse.SUPPRESS:
                    assert action.help, f"{parser.prog} {action.option_strings[0]} has no help"


def test_top_level_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert not REPR.search(capsys.readouterr().out)
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvgate {cli.version()}"


def test_policy_lists_its_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    (parser,) = parsers("serve", monkeypatch)
    (policy,) = (a for a in parser._actions if "--policy" in a.option_strings)
    assert policy.choices is not None and "kv" in policy.choices and "session" in policy.choices
