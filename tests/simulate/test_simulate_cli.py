"""`kvctl simulate` through the real typer app: JSON, table, and one-line errors."""

import json

from typer.testing import CliRunner

from kvctl.cli.main import app, main
from kvctl.simulate.runner import RESULT_KEYS
from kvctl.simulate.scenarios import run_scenario


def test_json_output_is_exactly_the_run_result() -> None:
    args = ["simulate", "--scenario", "multi-model", "--seed", "2", "--requests", "40", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data == run_scenario("multi-model", 2, requests=40)
    assert set(data["results"]["paged"]) == set(RESULT_KEYS)
    assert result.stderr == ""  # no progress bar with --json


def test_table_has_a_row_per_metric_and_a_column_per_allocator() -> None:
    result = CliRunner().invoke(app, ["simulate", "--requests", "30"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "random-lengths, seed 0" in out
    for text in ("contiguous", "paged", "OOM failure rate", "utilisation", "fragmentation"):
        assert text in out
    assert "0.0 %" in out  # the paged side's failure rate, formatted as a percentage


def test_unknown_scenario_is_one_error_line_and_a_non_zero_exit() -> None:
    result = CliRunner().invoke(app, ["simulate", "--scenario", "nonsense"])
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if "Invalid value" in line]
    assert len(errors) == 1
    assert "'nonsense' is not one of" in errors[0]
    assert "Traceback" not in result.output


def test_bad_request_count_exits_non_zero(capsys) -> None:
    assert main(["simulate", "--requests", "0"]) == 2
    assert "Traceback" not in capsys.readouterr().err
