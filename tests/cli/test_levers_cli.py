"""`kvctl sleep`, `kvctl wake` and `clear_prefix_cache` against a recorded fake of vLLM 0.32 and
SGLang (tests/engine_lever_server.py, a real HTTP server): each lever pulled and its state
changed on the server; a lever the server was started without is one line naming the flag or
variable that enables it; an engine without the lever, or given a kvctl agent's options, is a
usage error with nothing sent; a server that lies (a 500, garbage, a hang) is one line that
claims nothing."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest
from engine_lever_server import EngineState, LeverServer
from hostile_server import JSON, Answer, HostileServer

from kvctl.cli.options import ExitCode
from kvctl.engine_levers import (
    LeverAnswerError,
    LeverMissing,
    LeverOff,
    LeverRefused,
    clear_prefix_cache,
)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def serve(**state: Any) -> LeverServer:
    return LeverServer(EngineState(**state))


# ---- each lever pulled ----------------------------------------------------------------------


def test_vllm_sleeps_checks_sleep_mode_first_and_wakes(kvctl) -> None:
    with serve() as server:
        slept = kvctl("sleep", "--agent", server.agent, "--level", "2", "--yes")
        assert slept.exit_code == 0, slept.stderr
        assert server.state.sleeping and server.state.level == 2
        assert f"vLLM {server.url}: asleep (level 2)" in slept.stdout
        assert server.state.requests[:2] == [
            ("GET", "/server_info?config_format=json"),
            ("POST", "/sleep?level=2"),
        ]
        status = kvctl("sleep", "--status", "--agent", server.agent)
        assert status.stdout.strip() == f"vLLM {server.url}: asleep"
        woke = kvctl("wake", "--agent", server.agent, "--json")
        assert woke.exit_code == 0, woke.stderr
        assert json.loads(woke.stdout) == {
            "agent": server.agent,
            "engine": "vllm",
            "lever": "wake",
            "done": True,
            "sleeping": False,
            "level": None,
        }
        assert not server.state.sleeping


def test_vllm_sleep_defaults_to_level_1(kvctl) -> None:
    with serve() as server:
        result = kvctl("--agent", server.agent, "sleep", "-y")
        assert result.exit_code == 0, result.stderr
        assert ("POST", "/sleep?level=1") in server.state.requests


def test_clear_prefix_cache_of_vllm_and_sglang() -> None:
    with serve() as vllm, serve(engine="sglang") as sglang:
        for server in (vllm, sglang):
            result = clear_prefix_cache(server.agent)
            assert (result.engine, result.lever, result.done) == (
                server.state.engine,
                "prefix clear",
                True,
            )
        assert vllm.state.sent == [("POST", "/reset_prefix_cache")]
        assert sglang.state.sent == [("POST", "/flush_cache")]


def test_sglang_releases_and_resumes_its_memory(kvctl) -> None:
    with serve(engine="sglang") as server:
        slept = kvctl("sleep", "--agent", server.agent, "--yes")
        assert slept.exit_code == 0, slept.stderr
        assert server.state.sleeping
        assert server.state.requests == [
            ("GET", "/get_server_info"),
            ("POST", "/release_memory_occupation"),
        ]
        woke = kvctl("wake", "--agent", server.agent)
        assert woke.exit_code == 0, woke.stderr
        assert woke.stdout.strip() == f"SGLang {server.url}: awake"
        assert not server.state.sleeping


def test_a_fleet_of_two_engines_sleeps_after_one_question(kvctl) -> None:
    with serve() as vllm, serve(engine="sglang") as sglang:
        refused = kvctl("sleep", "-a", vllm.agent, "-a", sglang.agent, input="n\n")
        assert refused.exit_code == ExitCode.CANCELLED
        assert vllm.state.sent == [] and sglang.state.sent == []
        agreed = kvctl("sleep", "-a", vllm.agent, "-a", sglang.agent, input="y\n")
        assert agreed.exit_code == 0, agreed.stderr
        assert vllm.state.sleeping and sglang.state.sleeping


# ---- levers not enabled ---------------------------------------------------------------------


def test_vllm_without_dev_mode_names_the_variable(kvctl) -> None:
    with serve(dev_mode=False) as server:
        for args in (("sleep", "--yes"), ("wake",), ("sleep", "--status")):
            result = kvctl(*args, "--agent", server.agent)
            assert result.exit_code == ExitCode.ERROR
            line = one_line(result.stderr)
            assert "VLLM_SERVER_DEV_MODE=1" in line and "404" in line, line
        with pytest.raises(LeverOff, match="VLLM_SERVER_DEV_MODE=1"):
            clear_prefix_cache(server.agent)
        assert not server.state.sleeping


def test_vllm_without_sleep_mode_is_refused_before_anything_is_sent(kvctl) -> None:
    with serve(sleep_mode=False) as server:
        result = kvctl("sleep", "--agent", server.agent, "--yes")
        assert result.exit_code == ExitCode.ERROR
        line = one_line(result.stderr)
        assert "--enable-sleep-mode" in line and "nothing was sent" in line, line
        assert server.state.sent == []
        assert not server.state.sleeping


def test_sglang_without_memory_saver_is_refused(kvctl) -> None:
    with serve(engine="sglang", sleep_mode=False) as server:
        result = kvctl("sleep", "--agent", server.agent, "--yes")
        assert result.exit_code == ExitCode.ERROR
        assert "--enable-memory-saver" in one_line(result.stderr)
        assert server.state.sent == []


def test_a_busy_server_declines_the_prefix_clear() -> None:
    with serve(busy=True) as vllm, serve(engine="sglang", busy=True) as sglang:
        with pytest.raises(LeverRefused, match="retry when it is idle"):
            clear_prefix_cache(vllm.agent)
        with pytest.raises(LeverRefused, match="no request runs or waits"):
            clear_prefix_cache(sglang.agent)


# ---- levers an engine lacks, and kvctl agents -----------------------------------------------


@pytest.mark.parametrize("args", [("sleep", "--yes"), ("wake",), ("sleep", "--status")])
def test_trtllm_has_no_lever_and_nothing_is_sent(kvctl, args) -> None:
    with serve() as server:  # whatever answers there, nothing may reach it
        result = kvctl(*args, "--agent", f"trtllm+{server.url}")
        assert result.exit_code == ExitCode.USAGE
        line = one_line(result.stderr)
        assert "trtllm-serve has no" in line and "nothing was sent" in line, line
        assert server.state.requests == []


def test_trtllm_prefix_clear_names_what_it_lacks() -> None:
    with pytest.raises(LeverMissing, match="trtllm-serve has no route that clears"):
        clear_prefix_cache("trtllm+http://127.0.0.1:9")


def test_sglang_has_no_sleep_state(kvctl) -> None:
    result = kvctl("sleep", "--status", "--agent", "sglang+http://127.0.0.1:9")
    assert result.exit_code == ExitCode.USAGE
    assert "SGLang has no route" in one_line(result.stderr)


def test_sglang_refuses_a_level(kvctl) -> None:
    result = kvctl("sleep", "--level", "2", "--yes", "--agent", "sglang+http://127.0.0.1:9")
    assert result.exit_code == ExitCode.USAGE
    assert "--level is vLLM's" in one_line(result.stderr)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("sleep", "--yes", "--model", "a"), "--model names a kvctl agent's model"),
        (("wake", "--model", "a"), "--model names a kvctl agent's model"),
        (("sleep", "--yes", "--force"), "--force is a kvctl agent's"),
    ],
)
def test_an_agents_options_on_an_engine_are_a_usage_error(kvctl, args, said) -> None:
    result = kvctl(*args, "--agent", "vllm+http://127.0.0.1:9")
    assert result.exit_code == ExitCode.USAGE
    assert said in one_line(result.stderr)


# ---- engines that lie -----------------------------------------------------------------------


def lying(status: int, body: bytes, drip: float | None = None) -> dict[str, Answer]:
    """Every vLLM lever route answering `status` and `body`; /server_info as it should."""
    info = json.dumps({"vllm_config": {"model_config": {"enable_sleep_mode": True}}})
    answer = Answer(body, JSON, status, drip=drip)
    return {
        "/server_info": Answer(info.encode(), JSON),
        "/sleep": answer,
        "/wake_up": answer,
        "/is_sleeping": answer,
        "/reset_prefix_cache": answer,
    }


@pytest.mark.parametrize(
    ("status", "body", "said"),
    [
        (500, b'{"error": "Internal Server Error"}', "answered 500"),
        (200, b"<html>gateway</html>", "not as vLLM does (not JSON"),
        (200, b'{"status": "ok"}', 'not as vLLM does ("status" is not "sleeping"'),
        (200, b'{"is_sleeping": "maybe"}', "not as vLLM does (no str 'status'"),
    ],
)
def test_a_lying_sleep_is_one_line_claiming_nothing(kvctl, status, body, said) -> None:
    with HostileServer(lying(status, body)) as server:
        result = kvctl("sleep", "--yes", "--agent", f"vllm+{server.url}")
    assert result.exit_code == ExitCode.ERROR
    line = one_line(result.stderr)
    assert said in line and "whether it did sleep is not known" in line, line
    assert "asleep" not in result.stdout


def test_a_lying_prefix_reset_claims_nothing() -> None:
    unknown = "whether it did prefix clear is not known"
    with (
        HostileServer(lying(200, b'{"success": "yes"}')) as server,
        pytest.raises(LeverAnswerError, match=unknown),
    ):
        clear_prefix_cache(f"vllm+{server.url}")


def test_a_lying_sglang_flush_claims_nothing() -> None:
    routes = {"/flush_cache": Answer(b"OK", "text/plain")}
    with (
        HostileServer(routes) as server,
        pytest.raises(LeverAnswerError, match=re.escape('not "Cache flushed."')),
    ):
        clear_prefix_cache(f"sglang+{server.url}")


def test_a_hanging_engine_ends_within_the_timeout(kvctl) -> None:
    with HostileServer(lying(200, b'{"status": "awake", "tags": null}', drip=0.2)) as server:
        began = time.monotonic()
        result = kvctl("wake", "--agent", f"vllm+{server.url}", "--timeout", "1")
        took = time.monotonic() - began
    assert took < 2.5
    assert result.exit_code == ExitCode.UNREACHABLE
    line = one_line(result.stderr)
    assert "within 1 s" in line and "may or may not have acted" in line, line
    assert result.stdout == ""


def test_an_engine_wanting_a_token_names_it(kvctl) -> None:
    routes = {"/resume_memory_occupation": Answer(b'{"error": "no"}', JSON, 401)}
    with HostileServer(routes) as server:
        result = kvctl("wake", "--agent", f"sglang+{server.url}")
    assert result.exit_code == ExitCode.UNAUTHORIZED
    assert "--token" in one_line(result.stderr)


def test_a_rejected_level_quotes_the_engine_and_claims_nothing() -> None:
    from kvctl.engine_levers import SLEEP, EngineServer
    from kvctl.engines import VLLM

    with serve() as server, EngineServer(VLLM, server.url) as engine:
        with pytest.raises(LeverAnswerError, match=r"answered 400 .*less than or equal to 2"):
            engine.pull(SLEEP, level=3)
        assert not server.state.sleeping
