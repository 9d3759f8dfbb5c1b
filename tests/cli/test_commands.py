"""Every `kvctl` command against a real agent process: JSON keys, human output, exit codes,
confirmation prompts, the fleet table and token errors.

The session agent is shared with other suites, so a test that changes it (resize, config)
puts it back. Exit codes: 0 ok, 1 agent refused/failed, 2 usage, 3 unreachable,
4 unauthorized, 5 cancelled at a prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvctl.api import (
    DefragResult,
    Health,
    PoolSnapshot,
    ResizeRequest,
    ResizeResult,
    RuntimeSettings,
)
from kvctl.cli.defrag import STATE_KEYS
from kvctl.client import AgentClient

pytestmark = pytest.mark.integration

UNREACHABLE = "http://127.0.0.1:9"
"""The discard port: nothing listens there, so connecting is refused at once."""


def one_line_error(result, starts: str) -> None:
    """stderr is exactly one line, starting with `starts`, and nothing is a traceback."""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(starts), lines[0]
    assert "Traceback" not in result.output


def capacity(agent) -> int:
    with AgentClient(agent.url) as client:
        return client.pool().capacity_pages


# ---- status and the fleet table -----------------------------------------------------------


def test_status_of_one_agent(kvctl, agent) -> None:
    result = kvctl("--agent", agent.url, "status")
    assert result.exit_code == 0, result.output
    assert f"● up  {agent.url}" in result.stdout
    for label in ("alloc success", "fragmentation", "utilisation", "prefix hits", "capacity"):
        assert label in result.stdout
    assert result.stderr == ""


def test_status_json_keys(kvctl, agent) -> None:
    result = kvctl("--agent", agent.url, "status", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    (entry,) = data["agents"]
    assert set(entry) == {
        *("agent", "up", "error", "health", "pool", "alerts"),
        *("engine", "source", "model", "figures", "notes"),
    }
    assert (entry["agent"], entry["up"], entry["error"]) == (agent.url, True, None)
    assert (entry["engine"], entry["source"]) == ("kvctl", "agent")
    assert (
        entry["figures"]["capacity_tokens"]
        == entry["pool"]["capacity_pages"] * (entry["pool"]["page_size"])
    )
    assert set(entry["health"]) == set(Health.model_fields)
    assert set(entry["pool"]) == set(PoolSnapshot.model_fields) | set(
        PoolSnapshot.model_computed_fields
    )
    assert isinstance(entry["alerts"], list)


def test_fleet_table_shows_an_unreachable_agent_as_a_row(kvctl, agent, token_agent) -> None:
    urls = [agent.url, token_agent.url, UNREACHABLE]
    result = kvctl(*(f"--agent={url}" for url in urls), "--token", token_agent.token, "status")
    assert result.exit_code == 3
    rows = {url: line for line in result.stdout.splitlines() for url in urls if url in line}
    assert set(rows) == set(urls)
    assert " up " in rows[agent.url] and " up " in rows[token_agent.url]
    assert "DOWN" in rows[UNREACHABLE]
    one_line_error(result, f"kvctl: cannot reach agent at {UNREACHABLE} (")
    assert result.stderr.rstrip().endswith("is kvctl-agent running? use --agent URL")


def test_fleet_from_the_environment_as_json(kvctl, agent) -> None:
    result = kvctl("status", "--json", env={"KVCTL_AGENT": f"{agent.url}, {UNREACHABLE}"})
    assert result.exit_code == 3
    entries = json.loads(result.stdout)["agents"]
    assert [(e["agent"], e["up"]) for e in entries] == [(agent.url, True), (UNREACHABLE, False)]
    assert entries[1]["error"].startswith("cannot reach agent at")
    assert entries[1]["pool"] is None


@pytest.fixture
def other_server():
    """A real HTTP server that is not a kvctl agent (Python's own file server)."""
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_url_where_another_server_answers_is_a_wrong_url_exit_3(kvctl, other_server) -> None:
    result = kvctl("--agent", other_server, "pool", "show")
    assert result.exit_code == 3, result.output
    one_line_error(result, f"kvctl: {other_server} answered, but not as a kvctl agent (404")
    assert result.stderr.rstrip().endswith("check --agent URL or KVCTL_AGENT")


def test_timeout_works_after_the_command_too(kvctl) -> None:
    """A listener that never answers: the command's own --timeout is the one waited."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        result = kvctl("pool", "show", "-a", url, "--timeout", "0.3")
    assert result.exit_code == 3
    one_line_error(result, f"kvctl: agent {url} did not answer within 0.3 s")


def test_unreachable_agent_is_one_line_and_exit_3(kvctl) -> None:
    result = kvctl("--agent", UNREACHABLE, "pool", "show")
    assert result.exit_code == 3
    assert result.stdout == ""
    one_line_error(result, f"kvctl: cannot reach agent at {UNREACHABLE}")


def test_bad_agent_url_is_a_usage_error(kvctl) -> None:
    result = kvctl("--agent", "http://", "status")
    assert result.exit_code == 2
    one_line_error(result, "kvctl: --agent: 'http://' is not an agent URL")


# ---- tokens ------------------------------------------------------------------------------


def test_reading_an_agent_with_a_token_needs_it(kvctl, token_agent) -> None:
    result = kvctl("--agent", token_agent.url, "pool", "show")
    assert result.exit_code == 4
    one_line_error(
        result, f"kvctl: agent {token_agent.url}: 401 unauthorized; pass --token or set KVCTL_TOKEN"
    )


def test_missing_token_says_how_to_pass_one(kvctl, token_agent) -> None:
    result = kvctl("--agent", token_agent.url, "defrag", "--now")
    assert result.exit_code == 4
    one_line_error(
        result, f"kvctl: agent {token_agent.url}: 401 unauthorized; pass --token or set KVCTL_TOKEN"
    )


def test_wrong_token_says_to_check_it(kvctl, token_agent) -> None:
    result = kvctl("--agent", token_agent.url, "--token", "wrong", "defrag", "--now")
    assert result.exit_code == 4
    assert "the token was refused" in result.stderr


def test_token_from_option_or_environment(kvctl, token_agent) -> None:
    by_option = kvctl("defrag", "--now", "--agent", token_agent.url, "--token", token_agent.token)
    by_env = kvctl("-a", token_agent.url, "defrag", "--now", env={"KVCTL_TOKEN": token_agent.token})
    assert (by_option.exit_code, by_env.exit_code) == (0, 0), by_option.output + by_env.output


# ---- pool --------------------------------------------------------------------------------


def test_pool_show(kvctl, agent) -> None:
    data = json.loads(kvctl("-a", agent.url, "pool", "show", "--json").stdout)
    assert set(data) == set(PoolSnapshot.model_fields) | set(PoolSnapshot.model_computed_fields)
    human = kvctl("-a", agent.url, "pool", "show")
    assert human.exit_code == 0
    assert f"{data['capacity_pages']} pages (" in human.stdout
    assert f"in {data['segments']} segments of {data['segment_pages']} pages" in human.stdout


def test_pool_map(kvctl, agent) -> None:
    data = json.loads(kvctl("-a", agent.url, "pool", "map", "--json").stdout)
    assert set(data) == {"capacity_pages", "segment_pages", "runs", "pool"}
    assert sum(length for _state, _start, length in data["runs"]) == data["capacity_pages"]
    human = kvctl("-a", agent.url, "pool", "map", "--width", "60", "--rows", "2")
    assert human.exit_code == 0
    lines = human.stdout.splitlines()
    assert lines[0].lstrip().startswith("0 ")
    assert lines[-1].startswith("█ used ")
    assert "segment start" in lines[-1]


def test_resize_prompt_answered_no_changes_nothing(kvctl, agent) -> None:
    before = capacity(agent)
    result = kvctl("-a", agent.url, "pool", "resize", "--grow", "32", input="n\n")
    assert result.exit_code == 5
    assert f"{before} pages (" in result.output and f"→ {before + 32} pages" in result.output
    # the prompt is on stderr; CliRunner echoes the typed answer to stdout, not after it
    assert "Proceed? [y/N]:" in result.stderr
    assert result.stderr.endswith("kvctl: cancelled; nothing changed\n")
    assert capacity(agent) == before


def test_resize_without_an_answer_says_to_add_yes(kvctl, agent) -> None:
    before = capacity(agent)
    result = kvctl("-a", agent.url, "pool", "resize", "--grow", "32")  # no input: end of file
    assert result.exit_code == 5
    assert result.stderr.endswith(
        "kvctl: no answer to confirm with; nothing changed (add --yes to go ahead)\n"
    )
    assert capacity(agent) == before


def test_resize_says_when_segment_rounding_swallows_the_change(kvctl, agent) -> None:
    before = capacity(agent)
    with AgentClient(agent.url) as client:
        segment = client.pool().segment_pages
    result = kvctl("-a", agent.url, "pool", "resize", "--shrink", "1")
    assert result.exit_code == 0, result.output
    assert (
        f"{before - 1:,} pages asked, rounded up to whole segments of {segment:,} pages, "
        f"so nothing changes (change it by at least {segment:,} pages)"
    ) in result.stdout
    assert "Proceed?" not in result.stderr  # nothing to confirm
    assert capacity(agent) == before


def test_resize_grow_then_back(kvctl, agent) -> None:
    before = capacity(agent)
    grown = kvctl("-a", agent.url, "pool", "resize", "--grow", "32", "--yes", "--json")
    assert grown.exit_code == 0, grown.output
    data = json.loads(grown.stdout)
    assert set(data) == set(ResizeResult.model_fields)
    assert (data["old_pages"], data["new_pages"], data["direction"]) == (
        before,
        before + 32,
        "grow",
    )
    back = kvctl("-a", agent.url, "pool", "resize", "--pages", str(before), input="y\n")
    assert back.exit_code == 0, back.output
    assert f"shrink  {before + 32} pages" in back.stdout
    assert capacity(agent) == before


def test_resize_with_yes_names_the_rounding(kvctl, agent) -> None:
    """`--grow 1MiB --yes` printed a grow eight times what was asked with no word on why."""
    with AgentClient(agent.url) as client:
        pool = client.pool()
    before, segment = pool.capacity_pages, pool.segment_pages
    asked = -(-(1 << 20) // pool.bytes_per_page)
    assert asked % segment, "the test needs a grow that is not whole segments"
    result = kvctl("-a", agent.url, "pool", "resize", "--grow", "1MiB", "--yes")
    try:
        assert result.exit_code == 0, result.output
        rounded = -(-(before + asked) // segment) * segment
        assert (
            f"{before + asked:,} pages asked, rounded up to whole segments of {segment:,} pages"
        ) in " ".join(result.stdout.split())
        assert capacity(agent) == rounded
    finally:
        with AgentClient(agent.url) as client:
            client.resize(ResizeRequest(pages=before))
    assert capacity(agent) == before


def test_resize_refused_by_the_agent(kvctl, agent) -> None:
    before = capacity(agent)
    result = kvctl("-a", agent.url, "pool", "resize", "--size", "1TiB", "--yes")
    assert result.exit_code == 1
    one_line_error(result, f"kvctl: agent {agent.url}: resize refused: ")
    assert capacity(agent) == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "kvctl: pool resize: give exactly one of --pages, --size, --grow or --shrink"),
        (("--pages", "64", "--grow", "1"), "kvctl: pool resize: give exactly one"),
        (("--size", "8XB"), "kvctl: cannot read '8XB' as a size"),
        (("--shrink", "100000"), "kvctl: cannot shrink by 100000"),
    ],
)
def test_resize_usage_errors(kvctl, agent, args, message) -> None:
    result = kvctl("-a", agent.url, "pool", "resize", *args)
    assert result.exit_code == 2
    one_line_error(result, message)


def test_several_agents_ask_before_acting(kvctl, agent, token_agent) -> None:
    fleet = ("-a", agent.url, "-a", token_agent.url, "--token", token_agent.token)
    refused = kvctl(*fleet, "defrag", "--now", input="n\n")
    assert refused.exit_code == 5
    assert "Defragment the pools of 2 agents now?" in refused.output
    done = kvctl(*fleet, "defrag", "--now", "--json", input="y\n")
    assert done.exit_code == 0, done.output
    results = json.loads(done.stdout[done.stdout.index("[") :])  # after the echoed answer
    assert [entry["agent"] for entry in results] == [agent.url, token_agent.url]
    assert all(set(entry["result"]) == set(DefragResult.model_fields) for entry in results)


# ---- defrag, alerts, config ----------------------------------------------------------------


def test_defrag_now(kvctl, agent) -> None:
    data = json.loads(kvctl("-a", agent.url, "defrag", "--now", "--json").stdout)
    assert set(data) == set(DefragResult.model_fields)
    assert data["trigger"] == "manual"
    human = kvctl("-a", agent.url, "defrag", "--now", "--max-pages", "4")
    assert human.exit_code == 0
    assert "fragmentation" in human.stdout and "→" in human.stdout


def test_defrag_without_now_shows_the_state(kvctl, agent) -> None:
    data = json.loads(kvctl("-a", agent.url, "defrag", "--json").stdout)
    assert set(data) == set(STATE_KEYS)
    human = kvctl("-a", agent.url, "defrag")
    assert "kvctl defrag --now compacts the pool now" in human.stdout


def test_defrag_max_pages_without_now_is_a_usage_error(kvctl, agent) -> None:
    result = kvctl("-a", agent.url, "defrag", "--max-pages", "4")
    assert result.exit_code == 2
    one_line_error(result, "kvctl: --max-pages limits a defragmentation: add --now")


def test_alerts_list(kvctl, agent) -> None:
    result = kvctl("-a", agent.url, "alerts", "list", "--json")
    assert result.exit_code == 0
    assert set(json.loads(result.stdout)) == {"alerts"}
    human = kvctl("-a", agent.url, "alerts", "list", "--firing")
    assert human.exit_code == 0 and human.stdout.strip()


def test_config_show_and_set(kvctl, agent) -> None:
    shown = json.loads(kvctl("-a", agent.url, "config", "show", "--json").stdout)
    assert set(shown) == set(RuntimeSettings.model_fields)
    old = shown["defrag"]["fragmentation_threshold"]
    changed = kvctl("-a", agent.url, "config", "set", "defrag.fragmentation_threshold=0.45")
    try:
        assert changed.exit_code == 0, changed.output
        assert "defrag.fragmentation_threshold" in changed.stdout and "0.45" in changed.stdout
    finally:
        kvctl("-a", agent.url, "config", "set", f"defrag.fragmentation_threshold={old}")
    rejected = kvctl("-a", agent.url, "config", "set", "defrag.fragmentation_threshold=1.5")
    assert rejected.exit_code == 1
    one_line_error(rejected, f"kvctl: agent {agent.url}: config change rejected: ")
    malformed = kvctl("-a", agent.url, "config", "set", "threshold=0.4")
    assert malformed.exit_code == 2
    one_line_error(malformed, "kvctl: cannot read 'threshold=0.4'")


# ---- load, top, agent run --------------------------------------------------------------------


def test_load_json(kvctl, agent) -> None:
    args = ("-a", agent.url, "load", "-p", "chat", "-n", "6", "-c", "2", "--max-tokens", "4")
    result = kvctl(*args, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["requests"] == {"sent": 6, "completed": 6, "failed": 0, "cancelled": 0}
    assert data["tokens"]["output"] == 24
    assert data["ttft_s"]["p50"] <= data["latency_s"]["p50"]
    assert data["profile"] == "chat" and data["mode"] == "closed"


def test_load_human(kvctl, agent) -> None:
    result = kvctl(
        "-a", agent.url, "load", "--profile", "burst", "--requests", "4", "--rate", "50",
        "--max-tokens", "2",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    for text in ("time to first token", "p99", "open loop at 50/s", "4 sent, 4 ok"):
        assert text in result.stdout


def test_load_unreachable(kvctl) -> None:
    result = kvctl("-a", UNREACHABLE, "load", "-n", "2")
    assert result.exit_code == 3
    one_line_error(result, f"kvctl: cannot reach agent at {UNREACHABLE}")


def test_top_without_a_terminal_prints_one_snapshot(kvctl, agent) -> None:
    result = kvctl("-a", agent.url, "top")
    assert result.exit_code == 0
    assert f"● up  {agent.url}" in result.stdout
    once = json.loads(kvctl("-a", agent.url, "top", "--once", "--json").stdout)
    assert once["agents"][0]["up"] is True


def test_top_headless_prints_a_table_every_period(kvctl, agent) -> None:
    result = kvctl("-a", agent.url, "top", "--headless", "--duration", "0.4", "--every", "0.2")
    assert result.exit_code == 0
    assert result.stdout.count("kvctl top · ") == 3  # at 0, 0.2 and 0.4 s
    assert result.stdout.count(agent.url) == 3


def test_top_headless_json_is_one_line_per_table(kvctl) -> None:
    args = ("-a", UNREACHABLE, "top", "--headless", "--duration", "0.2", "--every", "0.1")
    result = kvctl(*args, "--json")
    assert result.exit_code == 3  # the agent was down at the last table
    ticks = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(ticks) == 3
    assert all(tick["agents"][0]["up"] is False and tick["time"] > 0 for tick in ticks)


@pytest.mark.slow
def test_agent_run_is_kvctl_agent(tmp_path) -> None:
    """`kvctl agent run` becomes the agent: same flags, same ready line, SIGTERM exits 0."""
    cmd = [sys.executable, "-m", "kvctl.cli.main", "agent", "run", "--port", "0"]
    cmd += ["--pool-pages", "64", "--segment-pages", "32"]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if "listening on http://127.0.0.1:" in line:
                break
        else:
            pytest.fail("kvctl agent run exited before listening")
        process.terminate()
        assert process.wait(30) == 0
    finally:
        process.kill()


@pytest.mark.slow
def test_load_stopped_by_sigterm_prints_its_report(agent) -> None:
    import signal
    import time

    command = [sys.executable, "-m", "kvctl.cli.main", "-a", agent.url, "load"]
    command += ["--profile", "chat", "--concurrency", "2", "--duration", "60", "--max-tokens", "4"]
    process = subprocess.Popen(
        [*command, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    time.sleep(4.0)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    report = json.loads(stdout)
    assert report["stopped_by"] == "SIGTERM"
    assert report["duration_s"] < 30
    assert report["requests"]["sent"] >= 1
    assert stderr.strip().splitlines()[-1].startswith("kvctl: stopped by SIGTERM after ")
