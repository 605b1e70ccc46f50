"""Every ``--help`` of the ``jddp`` command shows every option's default, read from the parsers themselves.

The parsers are walked, not listed: the ``jddp`` parser and its subcommands, the subcommands that parse their own
arguments (``launch``, ``bench``, ``goodput``: placeholders in the ``jddp`` parser) through their modules'
parsers, and every option of each. An option added without its default in the help fails here.
"""

from __future__ import annotations

import argparse

import pytest

from jddp import goodput
from jddp.cli import bench, launch
from jddp.cli import main as cli

# The subcommands whose arguments their own module parses (``jddp.cli.main.main`` hands them argv).
OWN_PARSERS = {
    "launch": launch.get_args_parser,
    "bench": bench.get_args_parser,
    "goodput": goodput.get_args_parser,
}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {
        name: sub
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items()
    }


def parsers() -> dict[str, argparse.ArgumentParser]:
    """``{command: parser}`` for ``jddp`` and every subcommand, the real parser of each."""
    top = cli.get_args_parser()
    found = {"jddp": top}
    for name, sub in _subparsers(top).items():
        own = [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]
        if own:
            found[f"jddp {name}"] = sub
        else:
            assert name in OWN_PARSERS, f"`jddp {name}` has no arguments of its own here: which parser is its?"
            found[f"jddp {name}"] = OWN_PARSERS[name]()
    return found


def options() -> list[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    out = []
    for command, parser in parsers().items():
        for action in parser._actions:
            if not action.option_strings or action.default is argparse.SUPPRESS:
                continue  # positionals (required, no default), --help, --version
            out.append((command, parser, action))
    return out


def rendered(default) -> set[str]:
    """How a default may read in a help string: as Python prints it, or as one types it (``1,2,4,8``, ``3``)."""
    forms = {str(default)}
    if isinstance(default, float):
        forms.add(f"{default:g}")
    if isinstance(default, (tuple, list)):
        forms.add(",".join(str(v) for v in default))
    return forms


def expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help line as ``--help`` prints it (``%(default)s`` and the like filled in), on one line."""
    return " ".join(parser._get_formatter()._expand_help(action).split())


OPTIONS = options()


def test_the_walk_finds_every_command():
    assert set(parsers()) == {"jddp", "jddp info", "jddp launch", "jddp bench", "jddp goodput"}
    assert len(OPTIONS) >= 20


@pytest.mark.parametrize(
    ("command", "parser", "action"), OPTIONS, ids=[f"{c}:{a.option_strings[-1]}" for c, _, a in OPTIONS]
)
def test_every_option_shows_its_default(command, parser, action):
    text = expanded_help(parser, action)
    assert "default" in text, f"{command} {action.option_strings[-1]}: its help does not say its default: {text!r}"
    if action.default is not None and not isinstance(action.default, bool):
        forms = rendered(action.default)
        assert any(f in text for f in forms), (
            f"{command} {action.option_strings[-1]}: the default is {action.default!r}, the help says {text!r}"
        )
    assert text in " ".join(parser.format_help().split()), "the help line is what --help prints"
