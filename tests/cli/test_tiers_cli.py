"""The tiers below the device pool through `kvctl` against a real agent with a host and a disk
tier: `pool show` and `status` show each tier (and nothing about tiers on an agent without
them), and `pool resize --tier host|disk` changes that tier's capacity after the usual
confirmation, while bad input is one line and changes nothing."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from agent_process import RunningAgent, launch_agent

from kvctl.api import CompletionRequest, TierReading
from kvctl.client import AgentClient

pytestmark = pytest.mark.integration

HOST = 16 << 20
DISK = 16 << 20


def one_line_error(result, starts: str) -> None:
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(starts), lines[0]
    assert "Traceback" not in result.output


def text(i: int) -> str:
    return " ".join(f"w{i}x{j}" for j in range(60))


@pytest.fixture(scope="module")
def tier_agent(tmp_path_factory) -> Iterator[RunningAgent]:
    """A 64-page pool over a 16 MiB host tier and a 16 MiB disk tier, with one prompt evicted
    from the device by four others and then sent again: its prefix comes back from the host."""
    disk = tmp_path_factory.mktemp("disk-tier")
    running = launch_agent(
        "--pool-pages", "64", "--segment-pages", "8", "--page-size", "16",
        "--host-tier-memory", str(HOST), "--disk-tier-path", str(disk),
        "--disk-tier-size", str(DISK),
    )  # fmt: skip
    try:
        with AgentClient(running.url, timeout=60) as client:
            for i in (0, 1, 2, 3, 4, 0):
                client.complete(CompletionRequest(prompt=text(i), max_tokens=1))
            deadline = time.monotonic() + 30
            while client.pool().prefix_hits_tokens_by_tier.get("host", 0) == 0:
                assert time.monotonic() < deadline, "no prefix came back from the host tier"
                time.sleep(0.2)
        yield running
    finally:
        running.stop()


def tiers(agent: RunningAgent) -> dict[str, TierReading]:
    with AgentClient(agent.url) as client:
        return {tier.tier: tier for tier in client.pool().tiers}


# ---- reading -----------------------------------------------------------------------------


def test_pool_show_has_a_row_per_tier_and_json_keeps_the_fields(kvctl, tier_agent) -> None:
    data = json.loads(kvctl("-a", tier_agent.url, "pool", "show", "--json").stdout)
    assert [tier["tier"] for tier in data["tiers"]] == ["host", "disk"]
    assert set(data["tiers"][0]) == set(TierReading.model_fields) | set(
        TierReading.model_computed_fields
    )
    by_tier = data["prefix_hits_tokens_by_tier"]
    assert sum(by_tier.values()) == data["prefix_hits_tokens_total"]
    assert by_tier["host"] > 0
    human = kvctl("-a", tier_agent.url, "pool", "show")
    assert human.exit_code == 0, human.output
    out = human.stdout
    assert "tiers      reused " in out and "prompt tokens since start: device " in out
    host = data["tiers"][0]
    assert f"host tier  lru; {host['used_pages']:,} of {host['capacity_pages']:,} pages" in out
    share = 100 * by_tier["host"] / data["prefix_hits_tokens_total"]
    assert f"reused {by_tier['host']:,} tokens ({share:.1f} %)" in out
    assert f"loaded {host['loaded_pages_total']:,} pages" in out and "/token" in out
    assert "disk tier  lru; " in out and "filesystem" in out
    assert "failures" not in out  # none happened: nothing to show


def test_status_shows_the_tiers_too(kvctl, tier_agent) -> None:
    result = kvctl("-a", tier_agent.url, "status")
    assert result.exit_code == 0, result.output
    assert "host tier  lru; " in result.stdout and "disk tier  lru; " in result.stdout
    entry = json.loads(kvctl("-a", tier_agent.url, "status", "--json").stdout)["agents"][0]
    assert [tier["tier"] for tier in entry["pool"]["tiers"]] == ["host", "disk"]


def test_an_agent_without_tiers_shows_nothing_about_them(kvctl, agent) -> None:
    for command in (("pool", "show"), ("status",)):
        result = kvctl("-a", agent.url, *command)
        assert result.exit_code == 0, result.output
        assert "tier" not in result.stdout


# ---- resizing ----------------------------------------------------------------------------


def test_resize_the_host_tier_by_size_then_back(kvctl, tier_agent) -> None:
    before = tiers(tier_agent)["host"]
    assert before.capacity_bytes == HOST
    args = ("-a", tier_agent.url, "pool", "resize", "--tier", "host")
    grown = kvctl(*args, "--size", "32MiB", "-y")
    try:
        assert grown.exit_code == 0, grown.output
        assert "host tier grow  256 pages (16 MiB) → 512 pages (32 MiB)" in grown.stdout
        assert tiers(tier_agent)["host"].capacity_bytes == 32 << 20
        unanswered = kvctl(*args, "--size", "16MiB")
        assert unanswered.exit_code == 5  # no answer to confirm with: nothing changed
        assert tiers(tier_agent)["host"].capacity_bytes == 32 << 20
    finally:
        kvctl(*args, "--size", "16MiB", "-y")
    assert tiers(tier_agent)["host"].capacity_bytes == HOST


def test_resize_the_disk_tier_in_pages_as_json(kvctl, tier_agent) -> None:
    old = tiers(tier_agent)["disk"].capacity_pages
    args = ("-a", tier_agent.url, "pool", "resize", "--tier", "disk")
    result = kvctl(*args, "--grow", "10", "--yes", "--json")
    try:
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert (data["tier"], data["old_pages"], data["new_pages"]) == ("disk", old, old + 10)
        assert tiers(tier_agent)["disk"].capacity_pages == old + 10
    finally:
        kvctl(*args, "--pages", str(old), "--yes")
    assert tiers(tier_agent)["disk"].capacity_pages == old


def test_turning_the_host_tier_off_asks_first_and_no_changes_nothing(kvctl, tier_agent) -> None:
    host = tiers(tier_agent)["host"]
    args = ("-a", tier_agent.url, "pool", "resize", "--tier", "host", "--pages", "0")
    result = kvctl(*args, input="n\n")
    assert result.exit_code == 5
    assert "Resize 1 host tier(s):" in result.stderr
    assert "host tier: 256 pages (16 MiB) → 0 pages (0 B); turns the tier off" in result.stderr
    held = host.used_pages
    assert (
        held and f"; {held:,} of the {held:,} pages it holds go to the disk tier" in result.stderr
    )
    assert result.stderr.endswith("kvctl: cancelled; nothing changed\n")
    assert tiers(tier_agent)["host"].capacity_pages == host.capacity_pages


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--tier", "host", "--size", "8XB"), "kvctl: cannot read '8XB' as a size"),
        (("--tier", "host", "--size", "100"), "kvctl: --size 100 is less than one page of the"),
        (("--tier", "disk", "--shrink", "1GiB"), "kvctl: cannot shrink by 1GiB: the disk tier has"),
        (("--tier", "host"), "kvctl: pool resize: give exactly one of"),
    ],
)
def test_bad_tier_sizes_are_one_line_and_change_nothing(kvctl, tier_agent, args, message) -> None:
    before = {name: tier.capacity_pages for name, tier in tiers(tier_agent).items()}
    result = kvctl("-a", tier_agent.url, "pool", "resize", *args, "--yes")
    assert result.exit_code == 2
    one_line_error(result, message)
    assert {name: tier.capacity_pages for name, tier in tiers(tier_agent).items()} == before


def test_an_unknown_tier_is_a_usage_error(kvctl, tier_agent) -> None:
    result = kvctl("-a", tier_agent.url, "pool", "resize", "--tier", "nvme", "--size", "1GiB")
    assert result.exit_code == 2
    assert "'nvme' is not one of 'device', 'host', 'disk'" in result.stderr


def test_a_tier_the_agent_does_not_have_changes_nothing(kvctl, agent) -> None:
    with AgentClient(agent.url) as client:
        before = client.pool().capacity_pages
    result = kvctl("-a", agent.url, "pool", "resize", "--tier", "disk", "--size", "1GiB", "-y")
    assert result.exit_code == 1
    one_line_error(
        result, f"kvctl: agent {agent.url} has no disk tier; start it with --disk-tier-path"
    )
    with AgentClient(agent.url) as client:
        assert client.pool().capacity_pages == before
