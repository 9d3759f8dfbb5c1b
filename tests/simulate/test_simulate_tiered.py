"""`kvctl simulate --scenario tiered-prefix`: the same multi-turn trace on a device pool of about a
quarter of its working set, without and with a host tier; the host tier must raise the prefix
hit rate, its hits must come from real loads, and the run must be a function of its seed."""

from __future__ import annotations

import itertools
import json

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.simulate.names import TIERED
from kvctl.simulate.scenarios import run_scenario
from kvctl.simulate.tiered import build_trace, ideal_hits, working_set_pages

TURNS = 96  # 16 conversations of 6 turns: about a second for both sides


@pytest.fixture(scope="module")
def run() -> dict:
    return run_scenario(TIERED, 0, requests=TURNS)


def test_the_host_tier_raises_the_hit_rate(run) -> None:
    without, with_host = run["results"]["device only"], run["results"]["device + host"]
    assert with_host["hit_rate"] > without["hit_rate"] + 0.15, (without, with_host)
    assert with_host["hit_rate"] <= with_host["ideal_hit_rate"] + 1e-9
    assert with_host["computed_prompt_tokens"] < without["computed_prompt_tokens"]
    assert without["hit_rate_by_tier"]["host"] == 0 and without["host_pages"] == 0
    assert with_host["hit_rate_by_tier"]["host"] > 0.15
    for side in (without, with_host):
        by_tier = side["hit_rate_by_tier"]
        assert sum(by_tier.values()) == pytest.approx(side["hit_rate"], abs=1e-5)
        assert sum(side["hit_tokens_by_tier"].values()) == side["hit_tokens"]


def test_host_hits_are_pages_the_tier_stored_and_loaded(run) -> None:
    side = run["results"]["device + host"]
    assert side["host_stored_pages"] > 0
    assert side["host_loaded_pages"] * 16 == side["hit_tokens_by_tier"]["host"]


def test_the_device_holds_about_a_quarter_of_the_working_set(run) -> None:
    for side in run["results"].values():
        share = side["device_pages"] / side["working_set_pages"]
        assert 0.25 <= share < 0.3, share  # rounded up to whole segments
        assert side["turns"] == TURNS and side["conversations"] == TURNS // 6
    assert run["results"]["device + host"]["host_pages"] == side["working_set_pages"]


def test_same_seed_same_numbers_other_seed_other_trace() -> None:
    first = json.dumps(run_scenario(TIERED, 3, requests=30))
    assert json.dumps(run_scenario(TIERED, 3, requests=30)) == first
    assert build_trace(3, 2, 3) != build_trace(4, 2, 3)


def test_trace_turns_extend_their_conversation() -> None:
    (chat,) = build_trace(0, 1, 3)
    for previous, turn in itertools.pairwise(chat):
        assert turn.prompt[: len(previous.prompt) + len(previous.reply)] == (
            previous.prompt + previous.reply
        )
    assert working_set_pages([chat], 16) == -(-(len(chat[-1].prompt) + len(chat[-1].reply)) // 16)
    assert ideal_hits([chat]) == sum(
        len(chat[k - 1].prompt) + len(chat[k - 1].reply) - 1 for k in (1, 2)
    )


def test_unknown_setting_is_refused() -> None:
    with pytest.raises(TypeError, match="unknown simulation settings: decode_chunk"):
        run_scenario(TIERED, 0, decode_chunk=4)


def test_cli_json_and_table() -> None:
    args = ["simulate", "--scenario", "tiered-prefix", "--requests", "30"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == run_scenario(TIERED, 0, requests=30)
    table = CliRunner().invoke(app, args, env={"COLUMNS": "120"})
    assert table.exit_code == 0, table.output
    for text in ("tiered-prefix, seed 0", "device only", "device + host", "from the host tier"):
        assert text in table.stdout
