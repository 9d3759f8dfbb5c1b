"""`kvctl` against a real agent serving two models: `--pool NAME` on every command that takes
one, every pool where none is named on the commands that only read, the agent's one-line
refusal on those that need one, and the budget, shares and pins as `pool show` and `status`
print them.

One agent for the module: `small` (64 pages of 64 KiB, 4 MiB) and `big` (64 pages of 128 KiB,
8 MiB) sharing a 12 MiB budget, all of it assigned. A test that resizes puts the size back and
releases the pin.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from agent_process import RunningAgent, launch_agent

from kvctl.api import DefragResult, PoolSnapshot, ResizeResult
from kvctl.cli.defrag import STATE_KEYS
from kvctl.client import AgentClient

pytestmark = pytest.mark.integration

TWO_MODELS = ("--model", "small=demo", "--model", "big=demo:8x4")
TWO_POOLS = ("--pool-pages", "64", "--segment-pages", "16")
POOLS = ("small", "big")


@pytest.fixture(scope="module")
def two_models() -> Iterator[RunningAgent]:
    running = launch_agent(*TWO_MODELS, *TWO_POOLS)
    yield running
    running.stop()


def several_models(url: str) -> str:
    """The agent's refusal of a command that needs one pool, as kvctl prints it."""
    return (
        f"kvctl: agent {url}: this agent serves several models ('small', 'big'); "
        "name one: /v1/pools/NAME (kvctl: --pool NAME)\n"
    )


def pool(url: str, name: str) -> PoolSnapshot:
    with AgentClient(url) as client:
        return client.pool(name)


def lines_with(text: str, *words: str) -> list[str]:
    return [line for line in text.splitlines() if all(word in line for word in words)]


# ---- reading: every pool, or the one named --------------------------------------------------


def test_pool_show_prints_the_budget_and_every_pool_with_its_share(kvctl, two_models) -> None:
    result = kvctl("-a", two_models.url, "pool", "show")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "budget  12 MiB shared by 2 pools: 12 MiB assigned, 0 B unassigned" in out
    assert lines_with(out, "█ small 4 MiB", "▓ big 8 MiB", "░ 0 B free")
    for name, page, budget_share in (("small", "64 KiB", "33.3 %"), ("big", "128 KiB", "66.7 %")):
        assert lines_with(out, f"pool {name} ─")  # each pool under a rule with its name
        assert lines_with(out, "page", f"16 tokens, {page}")
        assert lines_with(out, "share", f"of the 12 MiB budget ({budget_share}); floor 16 pages")
        assert lines_with(out, "kvctl pool resize --pages", f"--pool {name}")
    assert len(lines_with(out, "pinned", "no: the agent moves memory in and out")) == 2
    assert len(lines_with(out, "pressure", "none;", "pages reclaimable")) == 2
    assert len(lines_with(out, "rebalances", "none yet")) == 2


def test_pool_show_json_is_a_list_of_snapshots_or_the_one_named(kvctl, two_models) -> None:
    every = json.loads(kvctl("-a", two_models.url, "pool", "show", "--json").stdout)
    assert [snapshot["pool"] for snapshot in every] == list(POOLS)
    for snapshot in every:
        PoolSnapshot.model_validate(snapshot)
        assert snapshot["share"]["budget_bytes"] == 12 << 20
    named = json.loads(
        kvctl("-a", two_models.url, "pool", "show", "--pool", "big", "--json").stdout
    )
    assert named["pool"] == "big" and named["bytes_per_page"] == 128 << 10


def test_pool_show_of_one_pool(kvctl, two_models) -> None:
    result = kvctl("-a", two_models.url, "pool", "show", "--pool", "big")
    assert result.exit_code == 0, result.output
    assert lines_with(result.stdout, "pool", "big on cpu")
    assert lines_with(result.stdout, "share", "8 MiB of the 12 MiB budget (66.7 %)")
    assert "small" not in result.stdout and "budget  12 MiB shared" not in result.stdout


def test_an_unknown_pool_is_named_with_the_ones_served(kvctl, two_models) -> None:
    for args in (("pool", "show"), ("pool", "map"), ("defrag", "--now"), ("pool", "release")):
        result = kvctl("-a", two_models.url, *args, "--pool", "nope")
        assert result.exit_code == 1, (args, result.output)
        assert result.stderr == (
            f"kvctl: agent {two_models.url}: model 'nope' is not served here; "
            "this agent serves 'small', 'big'\n"
        )


def test_pool_map_of_a_named_pool(kvctl, two_models) -> None:
    data = json.loads(kvctl("-a", two_models.url, "pool", "map", "--pool", "big", "--json").stdout)
    assert data["pool"]["pool"] == "big"
    assert sum(length for _, _, length in data["runs"]) == data["capacity_pages"] == 64


def test_defrag_state_of_every_pool(kvctl, two_models) -> None:
    data = json.loads(kvctl("-a", two_models.url, "defrag", "--json").stdout)
    assert [state["pool"] for state in data] == list(POOLS)
    assert all(set(state) == {"pool", *STATE_KEYS} for state in data)
    human = kvctl("-a", two_models.url, "defrag").stdout
    for name in POOLS:
        assert f"kvctl defrag --now --pool {name} compacts the pool now" in human


@pytest.mark.parametrize(
    "args",
    [
        ("pool", "map"),
        ("pool", "resize", "--shrink", "16", "--yes"),
        ("pool", "release"),
        ("defrag", "--now"),
    ],
    ids=lambda args: " ".join(args[:2]),
)
def test_a_command_that_needs_one_pool_says_to_name_one(kvctl, two_models, args) -> None:
    before = [pool(two_models.url, name) for name in POOLS]
    result = kvctl("-a", two_models.url, *args)
    assert result.exit_code == 1, result.output
    assert result.stderr == several_models(two_models.url)
    after = [pool(two_models.url, name) for name in POOLS]
    for old, new in zip(before, after, strict=True):  # nothing changed
        assert new.capacity_pages == old.capacity_pages
        assert new.defrag_runs_total == old.defrag_runs_total
        assert new.share is not None and not new.share.pinned


# ---- acting on one pool ---------------------------------------------------------------------


def test_defrag_now_of_one_pool(kvctl, two_models) -> None:
    before = {name: pool(two_models.url, name).defrag_runs_total["manual"] for name in POOLS}
    result = kvctl("-a", two_models.url, "defrag", "--now", "--pool", "big", "--json")
    assert result.exit_code == 0, result.output
    DefragResult.model_validate_json(result.stdout)
    human = kvctl("-a", two_models.url, "defrag", "--now", "--pool", "big")
    assert lines_with(human.stdout, "pool", "big")
    after = {name: pool(two_models.url, name).defrag_runs_total["manual"] for name in POOLS}
    assert after == {"small": before["small"], "big": before["big"] + 2}


def test_resize_pins_the_pool_and_release_hands_it_back(kvctl, two_models) -> None:
    url = two_models.url
    shrunk = kvctl("-a", url, "pool", "resize", "--pool", "small", "--shrink", "16", input="y\n")
    try:
        assert shrunk.exit_code == 0, shrunk.output
        assert f"{url} pool small: 64 pages (4 MiB) → 48 pages (3 MiB); pins the pool" in (
            shrunk.stderr
        )
        assert lines_with(shrunk.stdout, "shrink", "64 pages (4 MiB) → 48 pages (3 MiB)")
        assert lines_with(
            shrunk.stdout, "pinned", "now pinned", "until kvctl pool release --pool small"
        )
        small = pool(url, "small")
        assert small.capacity_pages == 48 and small.share is not None and small.share.pinned
        assert not pool(url, "big").share.pinned

        shown = kvctl("-a", url, "pool", "show", "--pool", "small").stdout
        assert lines_with(shown, "pinned", "yes: the agent moves no memory in or out of it")
        assert lines_with(shown, "kvctl pool release --pool small hands it back")
        status = kvctl("-a", url, "status").stdout
        assert lines_with(status, "small", "48 pages (3 MiB)", "pinned")
        assert "12 MiB shared by 2 pools: 11 MiB assigned, 1 MiB unassigned" in status

        released = kvctl("-a", url, "pool", "release", "--pool", "small")
        assert released.exit_code == 0, released.output
        assert released.stdout.strip() == (
            "pool small released: the agent may move memory in and out of it again"
        )
        assert not pool(url, "small").share.pinned
        again = kvctl("-a", url, "pool", "release", "--pool", "small", "--json")
        assert json.loads(again.stdout) == {"pool": "small", "was_pinned": False}
    finally:
        back = kvctl(
            "-a", url, "pool", "resize", "--pool", "small", "--pages", "64", "--json", "-y"
        )
        kvctl("-a", url, "pool", "release", "--pool", "small")
    assert back.exit_code == 0, back.output
    assert ResizeResult.model_validate_json(back.stdout).pinned
    assert pool(url, "small").capacity_pages == 64 and not pool(url, "small").share.pinned


def test_release_of_a_pool_that_shares_no_budget_is_refused(kvctl, agent) -> None:
    result = kvctl("-a", agent.url, "pool", "release")
    assert result.exit_code == 1
    assert result.stderr.startswith(
        f"kvctl: agent {agent.url}: release refused: this pool shares no budget"
    )


# ---- status: one row per pool, and per agent and pool in a fleet ------------------------------


def test_status_of_an_agent_with_two_pools_has_a_row_per_pool(kvctl, two_models) -> None:
    result = kvctl("-a", two_models.url, "status")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"● up  {two_models.url}" in out
    assert "budget  12 MiB shared by 2 pools" in out
    header = lines_with(out, "pool", "capacity", "of budget", "floor–ceiling", "rebalancing")
    assert len(header) == 1
    assert lines_with(out, "small", "64 pages (4 MiB)", "33.3 %", "16–", "calm")
    assert lines_with(out, "big", "64 pages (8 MiB)", "66.7 %", "16–", "calm")


def test_status_json_has_an_entry_per_pool_of_the_same_shape(kvctl, two_models) -> None:
    data = json.loads(kvctl("-a", two_models.url, "status", "--json").stdout)
    entries = data["agents"]
    assert [entry["pool"]["pool"] for entry in entries] == list(POOLS)
    for entry in entries:
        assert set(entry) == {
            *("agent", "up", "error", "health", "pool", "alerts"),
            *("engine", "source", "model", "figures", "notes"),
        }
        assert entry["agent"] == two_models.url and entry["up"]
        assert entry["model"] == entry["pool"]["pool"]
        assert all(a["labels"]["pool"] == entry["pool"]["pool"] for a in entry["alerts"])


def test_the_fleet_table_has_a_row_per_agent_and_pool(kvctl, agent, two_models) -> None:
    result = kvctl("-a", agent.url, "-a", two_models.url, "status")
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    assert [(row[0], row[1], row[2]) for row in rows if row[0].startswith("http")] == [
        (agent.url, "up", "demo"),
        (two_models.url, "up", "small"),
        (two_models.url, "up", "big"),
    ]
    once = json.loads(
        kvctl("-a", agent.url, "-a", two_models.url, "top", "--once", "--json").stdout
    )
    assert [(e["agent"], e["pool"]["pool"]) for e in once["agents"]] == [
        (agent.url, "demo"),
        (two_models.url, "small"),
        (two_models.url, "big"),
    ]


# ---- load: one model at a time -----------------------------------------------------------------


def test_load_names_its_model_and_refuses_to_guess(kvctl, two_models) -> None:
    before = pool(two_models.url, "big").generation_tokens_total
    result = kvctl(
        "-a", two_models.url, "--json", "load", "--model", "big", "-n", "3", "--max-tokens", "4"
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["requests"]["completed"] == 3 and report["tokens"]["output"] == 12
    deadline = time.monotonic() + 5  # snapshots are published every 100 ms
    while pool(two_models.url, "big").generation_tokens_total < before + 12:
        assert time.monotonic() < deadline, "big's pool did not serve the load"
        time.sleep(0.05)
    unnamed = kvctl("-a", two_models.url, "load", "-n", "1")
    assert unnamed.exit_code == 2
    assert "serves several models ('small', 'big'); give --model" in unnamed.stderr
    unknown = kvctl("-a", two_models.url, "load", "--model", "nope", "-n", "1")
    assert unknown.exit_code == 2 and "does not serve 'nope'" in unknown.stderr
