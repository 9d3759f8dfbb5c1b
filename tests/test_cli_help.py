"""Every command's help read at 80 columns: nothing cut off, no stray line breaks, every value
named in a word instead of a Python type.

typer's rich help kept the line breaks written into docstrings, so a re-wrapped paragraph left
short lines ("that tier;" then "pages that no longer fit..."), and `kvctl-agent --help` cut
`--model` off at "demo:LAYERSxKV_H…" and showed `<list[str]>` as its type.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
import typer.main

from kvctl.agent.startup.settings import SPECS
from kvctl.cli.main import app, main
from kvctl.command_help import flowing

WIDTH = 80
PASSED_ON = ("agent", "run")
"""It runs kvctl-agent with its arguments, --help included: the agent's help, read below."""
PYTHON_TYPE = re.compile(r"<(bool|int|float|str|list|path|int range|float range)[^>]*>")


def command_paths() -> Iterator[tuple[str, ...]]:
    def walk(command: object, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
        yield path
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            yield from walk(sub, (*path, name))

    for path in walk(flowing(typer.main.get_command(app)), ()):
        if path != PASSED_ON:
            yield path


def stray_breaks(lines: list[str], room: int) -> list[str]:
    """Lines of a paragraph that end although the next line's first word would have fit."""
    found = []
    for line, after in itertools.pairwise(lines):
        text, following = line.strip(" │"), after.strip(" │")
        if not text or not following or following.startswith(("-", "•", "*")):
            continue
        if len(text) + 1 + len(following.split()[0]) < room:
            found.append(f"{text!r} then {following!r}")
    return found


def description(shown: str) -> list[str]:
    """The help's prose: after the usage line, before the first panel."""
    lines = shown.splitlines()
    start = next(i for i, line in enumerate(lines) if "Usage:" in line) + 1
    end = next((i for i, line in enumerate(lines) if line.startswith("╭")), len(lines))
    return lines[start:end]


@pytest.mark.parametrize("path", list(command_paths()), ids=" ".join)
def test_kvctl_help_at_80_columns(path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    monkeypatch.delenv("TERMINAL_WIDTH", raising=False)
    assert main([*path, "--help"]) == 0
    shown = capsys.readouterr().out
    assert shown.strip()
    too_wide = [line for line in shown.splitlines() if len(line) > WIDTH]
    assert not too_wide, too_wide
    assert "…" not in shown, [line for line in shown.splitlines() if "…" in line]
    options = shown[shown.find("Options") :]
    assert not PYTHON_TYPE.search(options), PYTHON_TYPE.findall(options)
    assert not stray_breaks(description(shown), WIDTH - 6)


def test_agent_help_at_80_columns() -> None:
    env = {**os.environ, "COLUMNS": str(WIDTH)}
    env.pop("TERMINAL_WIDTH", None)
    done = subprocess.run(
        [sys.executable, "-m", "kvctl.agent.startup.main", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    shown = done.stdout
    assert not [line for line in shown.splitlines() if len(line) > WIDTH]
    assert "…" not in shown
    assert not PYTHON_TYPE.search(shown), PYTHON_TYPE.findall(shown)
    assert "--model [NAME=]PATH" in shown
    words = shown.split()
    for spec in SPECS.values():
        for flag in spec.flags:
            assert flag in words or f"{flag}," in words, flag  # whole, never cut


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ("load", "--profile", "x"),
            "kvctl: error: Invalid value for '--profile' / '-p': Value error, 'x' is not one of "
            "'chat', 'random-lengths', 'long-context', 'burst'; see kvctl --help",
        ),
        (("nope",), "kvctl: error: No such command 'nope'; see kvctl --help"),
    ],
)
def test_a_usage_error_is_one_sentence_then_the_pointer_to_help(args, line, capsys) -> None:
    """click's messages end with a full stop, which used to stand before "; see" ('burst'.;)."""
    assert main(list(args)) == 2
    assert capsys.readouterr().err.splitlines() == [line]
