"""`kvctl` starts fast: help and version work without loading torch or the agent."""

import subprocess
import sys

from typer.testing import CliRunner

from kvctl import __version__
from kvctl.cli.main import app, main

# Run in a fresh interpreter so modules imported by other tests don't hide a heavy import.
_PROBE = """
import sys
from typer.testing import CliRunner
from kvctl.cli.main import app
result = CliRunner().invoke(app, ["--help"])
assert result.exit_code == 0, result.output
heavy = sorted(
    name for name in sys.modules
    if name == "torch" or name.startswith(("torch.", "kvctl.agent"))
)
print(",".join(heavy))
"""


def test_help_loads_neither_torch_nor_the_agent() -> None:
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == ""


_DASHBOARD_PROBE = """
import sys
import kvctl.tui.app
cli = [name for name in sys.modules if name == "kvctl.cli" or name.startswith("kvctl.cli.")]
print(",".join(sorted(cli)))
"""


def test_the_dashboard_does_not_import_the_cli() -> None:
    """The CLI starts the TUI; the TUI takes its looks from kvctl.view, so no import cycle."""
    probe = subprocess.run(
        [sys.executable, "-c", _DASHBOARD_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == ""


def test_help_lists_usage() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "Usage" in result.output


def test_version_prints_name_and_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"kvctl {__version__}\n"


def test_main_returns_exit_code_instead_of_raising(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"kvctl {__version__}\n"
    assert main(["--no-such-option"]) == 2


def test_console_script_runs_as_module() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvctl.cli.main", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"kvctl {__version__}\n"
