"""A real agent where it hurts: tiny pools, floods, vanishing and slow clients, hostile bodies.

Each case asserts the clear answer (a status and a message that says what to do) and that the
pool is unchanged, or its pages released, afterwards."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvctl.api import PoolSnapshot

pytestmark = pytest.mark.integration


def client(agent, timeout: float = 60) -> httpx.Client:
    return httpx.Client(base_url=agent.url, timeout=timeout)


def snapshot(http: httpx.Client) -> PoolSnapshot:
    return PoolSnapshot.model_validate(http.get("/v1/pool").json())


def counters(http: httpx.Client, name: str) -> dict[str, float]:
    """One labelled counter family from /metrics, by its non-pool label's value."""
    for family in text_string_to_metric_families(http.get("/metrics").text):
        if family.name == name.removesuffix("_total"):
            return {
                next(v for k, v in s.labels.items() if k != "pool"): s.value
                for s in family.samples
                if s.name == name
            }
    raise AssertionError(f"{name} is not exported")


def wait_for(condition, timeout: float = 10.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"not true within {timeout} s")


def unchanged_state(http: httpx.Client) -> tuple:
    s = snapshot(http)
    pages = http.get("/v1/pool/map").json()["runs"]
    return (s.capacity_pages, s.used_pages, s.alloc_attempts_total, s.requests_waiting, pages)


# ---- the stall ------------------------------------------------------------------------------


@pytest.mark.slow
def test_chat_load_on_a_tiny_pool_never_stalls(start_agent) -> None:
    """The load that stalled the agent for two minutes: every request now completes or is
    refused with a 4xx, none times out, and the queue never stands still."""
    agent = start_agent("--pool-pages", "64", "--segment-pages", "16")
    stalled: list[float] = []
    done = threading.Event()

    def watch() -> None:
        with client(agent) as http:
            while not done.is_set():
                stalled.append(snapshot(http).queue_stalled_seconds)
                time.sleep(0.25)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run = subprocess.run(
            [
                *(sys.executable, "-m", "kvctl.cli.main", "--agent", agent.url, "--json"),
                *("load", "--profile", "chat", "--concurrency", "8", "--seed", "5"),
                *("--duration", "20"),
            ],
            capture_output=True,
            text=True,
            timeout=110,
        )
    finally:
        done.set()
        watcher.join()
    assert run.returncode in (0, 1), run.stderr
    report = json.loads(run.stdout)
    requests = report["requests"]
    assert requests["sent"] >= 50 and requests["cancelled"] == 0, report
    assert requests["completed"] + requests["failed"] == requests["sent"], report
    for message in report["errors"]:  # refusals only: a request that cannot fit the pool
        assert "completion rejected" in message and "pool resize --pages" in message, message
    assert max(stalled) < 5.0, f"the queue stood still for {max(stalled):.1f} s"
    with client(agent) as http:  # the snapshot is at most 100 ms old
        wait_for(lambda: (s := snapshot(http)).requests_waiting == s.requests_running == 0)


# ---- honest refusal -------------------------------------------------------------------------


def test_a_request_that_can_never_fit_is_a_400_naming_the_room_it_needs(start_agent) -> None:
    agent = start_agent("--pool-pages", "32", "--segment-pages", "8")
    body = {"prompt": "p" * 600, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    with client(agent) as http:
        before = unchanged_state(http)
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert "needs 57 pages of 16 tokens and the pool holds 32" in message
        assert f"`kvctl --agent {agent.url} pool resize --pages 64`" in message
        assert unchanged_state(http) == before
        wait_for(lambda: counters(http, "kvctl_requests_rejected_total")["too_large"] == 1)
        # what fits runs to max_tokens, and gives the same tokens whatever the pool's size
        fits = {**body, "prompt": "p" * 100, "return_token_ids": True}
        first = http.post("/v1/completions", json=fits).json()["choices"][0]
        assert first["finish_reason"] == "length" and len(first["token_ids"]) == 300
        assert http.post("/v1/pool/resize", json={"pages": 64}).status_code == 200
        again = http.post("/v1/completions", json=fits).json()["choices"][0]
        assert again["token_ids"] == first["token_ids"]
        wait_for(lambda: counters(http, "kvctl_requests_finished_total")["length"] == 2)


def test_a_prompt_over_the_models_context_is_a_400(agent) -> None:
    with client(agent) as http:
        before = unchanged_state(http)
        response = http.post(
            "/v1/completions", json={"prompt": "c" * 4000, "max_tokens": 200, "temperature": 0}
        )
        assert response.status_code == 400
        assert "exceeds the model's context of 4096 tokens" in response.json()["error"]["message"]
        assert unchanged_state(http) == before


# ---- back-pressure --------------------------------------------------------------------------


async def flood(url: str, count: int, body: dict) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        return await asyncio.gather(
            *(http.post("/v1/completions", json=body) for _ in range(count))
        )


def test_a_flood_past_the_queue_gets_429_with_retry_after(start_agent) -> None:
    agent = start_agent("--max-waiting", "16", "--max-batch-seqs", "4", *POOL)
    body = {"prompt": "flood", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    responses = asyncio.run(flood(agent.url, 300, body))
    statuses = [r.status_code for r in responses]
    refused = [r for r in responses if r.status_code == 429]
    assert set(statuses) <= {200, 429} and refused and statuses.count(200) >= 20
    assert all(r.headers["retry-after"] == "1" for r in refused)
    assert (
        "requests are waiting, the most this agent queues" in refused[0].json()["error"]["message"]
    )
    with client(agent) as http:  # the snapshot is at most 100 ms old
        wait_for(
            lambda: counters(http, "kvctl_requests_rejected_total")["queue_full"] == len(refused)
        )
        wait_for(
            lambda: counters(http, "kvctl_requests_finished_total")["length"] == statuses.count(200)
        )
        final = wait_for(lambda: (s := snapshot(http)).used_pages == 0 and s)
        assert final.max_waiting == 16


POOL = ("--pool-pages", "2048", "--segment-pages", "256", "--page-size", "1")
"""Pages of one token: a 1,000-token request runs for seconds on the demo model."""


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_request_whose_client_left_is_aborted_and_its_pages_freed(start_agent, stream) -> None:
    agent = start_agent(*POOL)
    host, port = urlsplit(agent.url).hostname, urlsplit(agent.url).port
    request = {"prompt": "bye", "max_tokens": 1000, "ignore_eos": True, "stream": stream}
    body = json.dumps(request).encode()
    with client(agent) as http:
        sock = socket.create_connection((host, port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(lambda: snapshot(http).requests_running == 1)
        sock.close()
        final = wait_for(
            lambda: (s := snapshot(http)).requests_running == 0 and s.used_pages == 0 and s,
            timeout=5,
        )
        wait_for(lambda: counters(http, "kvctl_requests_finished_total")["abort"] == 1)
        assert final.requests_finished_total.get("length", 0) == 0


@pytest.mark.slow
def test_slow_and_idle_connections_are_closed(start_agent, tmp_path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('header_timeout = "1s"\nbody_timeout = "1s"\n')
    agent = start_agent("--config", str(config), "--pool-pages", "64", "--segment-pages", "16")
    address = (urlsplit(agent.url).hostname, urlsplit(agent.url).port)

    def closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
        """Whether the server closes `sock` within `seconds`, sending `trickle` a byte at a
        time meanwhile (a slowloris client)."""
        sock.settimeout(0.25)
        deadline = time.monotonic() + seconds
        for byte in trickle:
            try:  # closed with a byte of ours unread: the kernel answers with a reset
                sock.sendall(bytes([byte]))
                if sock.recv(1) == b"":
                    return True
            except TimeoutError:
                pass
            except (ConnectionResetError, BrokenPipeError):
                return True
        while time.monotonic() < deadline:
            try:
                if sock.recv(4096) == b"":
                    return True
            except TimeoutError:
                continue
            except ConnectionResetError:
                return True
        return False

    with socket.create_connection(address) as idle:
        assert closed_within(idle, 4)
    with socket.create_connection(address) as slow:
        headers = b"GET /healthz HTTP/1.1\r\nHost: agent\r\nX-Slow: " + b"a" * 40
        assert closed_within(slow, 4, trickle=headers)
    with socket.create_connection(address) as stuck:
        stuck.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt"'
        )
        assert closed_within(stuck, 4)
    with client(agent) as http:  # working clients are untouched
        assert http.get("/healthz").status_code == 200


# ---- hostile bodies -------------------------------------------------------------------------


def test_stop_strings_are_capped_before_any_work(agent) -> None:
    with client(agent) as http:
        before = unchanged_state(http)
        many = http.post("/v1/completions", json={"prompt": "x", "stop": ["a"] * 170_000})
        assert many.status_code == 422
        assert many.json()["error"]["message"] == "stop: at most 16 stop strings, got 170000"
        long = http.post("/v1/completions", json={"prompt": "x", "stop": "s" * 300})
        assert long.status_code == 422
        assert "stop: a stop string has 1 to at most 256 characters" in long.text
        assert unchanged_state(http) == before


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.slow
def test_large_text_prompts_are_refused_untokenized_and_memory_comes_back(start_agent) -> None:
    agent = start_agent("--pool-pages", "64", "--segment-pages", "16")
    body = {"prompt": "word " * 200_000, "max_tokens": 4}  # 1,000,000 bytes, under the body cap
    with client(agent) as http:
        http.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 2})
    before = rss_bytes(agent.process.pid)
    for _ in range(3):
        responses = asyncio.run(flood(agent.url, 50, body))
        assert {r.status_code for r in responses} == {400}
    message = responses[0].json()["error"]["message"]
    assert "the prompt is 1000000 bytes, over this agent's limit of 65536" in message
    # The agent trims its heap after a second idle (kvctl.agent.memory). Measured on this VM:
    # without the trim the three floods leave 64-112 MiB behind, with it -10 to 37 MiB (what is
    # left varies with where the bodies fell in the arenas), so 48 MiB tells the two apart.
    deadline = time.monotonic() + 10.0
    while (grown := rss_bytes(agent.process.pid) - before) >= 48 << 20:
        assert time.monotonic() < deadline, (
            f"RSS still {grown >> 20} MiB higher 10 s after 150 one-megabyte prompts"
        )
        time.sleep(0.25)
    with client(agent) as http:
        wait_for(lambda: counters(http, "kvctl_requests_rejected_total")["invalid"] == 150)


# ---- privacy and audit ----------------------------------------------------------------------


@pytest.mark.slow
def test_cached_tokens_are_reported_only_when_the_operator_opts_in(start_agent) -> None:
    body = {"prompt": "a shared system prompt and a question", "max_tokens": 2}
    quiet = start_agent("--pool-pages", "64", "--segment-pages", "16")
    loud = start_agent("--pool-pages", "64", "--segment-pages", "16", "--report-cached-tokens")
    with client(quiet) as http:
        for _ in range(2):
            usage = http.post("/v1/completions", json=body).json()["usage"]
        assert "prompt_tokens_details" not in usage or usage["prompt_tokens_details"] is None
    with client(loud) as http:
        for _ in range(2):
            usage = http.post("/v1/completions", json=body).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0


UNUSED_ACTIONS = ("prefix_pin", "prefix_unpin", "prefix_clear", "prefix_move", "sleep", "wake")


def test_every_mutation_is_audited_with_its_caller(start_agent) -> None:
    agent = start_agent("--pool-pages", "64", "--segment-pages", "16", token="s3cret")
    headers = {"Authorization": "Bearer s3cret"}
    with httpx.Client(base_url=agent.url, timeout=30) as http:
        assert http.post("/v1/pool/resize", json={"pages": 80}).status_code == 401
        assert http.post("/v1/pool/resize", json={"pages": 80}, headers=headers).status_code == 200
        assert http.post("/v1/defrag", json={}, headers=headers).status_code == 200
        patch = {"defrag": {"fragmentation_threshold": 0.6}}
        assert http.patch("/v1/config", json=patch, headers=headers).status_code == 200
        bad = {"defrag": {"fragmentation_threshold": 7}}
        assert http.patch("/v1/config", json=bad, headers=headers).status_code == 422
        authorized = httpx.Client(base_url=agent.url, headers=headers)
        expected = {"resize": 1, "defrag": 1, "release": 0, "config": 1, "alert_test": 0}
        expected |= {action: 0 for action in UNUSED_ACTIONS}
        wait_for(lambda: counters(authorized, "kvctl_admin_actions_total") == expected)
    lines = wait_for(
        lambda: (
            (found := [line for line in agent.log if "audit action=" in line])
            and len(found) == 5
            and found
        ),
        timeout=5,
    )
    assert any(
        "action=resize outcome=unauthorized" in line and "authenticated=false" in line
        for line in lines
    )
    resized = next(line for line in lines if "action=resize outcome=ok" in line)
    assert "caller=127.0.0.1:" in resized and "authenticated=true" in resized
    assert '"new_pages": 80' in resized and '"old_pages": 64' in resized
    changed = next(line for line in lines if "action=config outcome=ok" in line)
    assert '"defrag.fragmentation_threshold": [0.5, 0.6]' in changed
    assert any("action=config outcome=refused" in line for line in lines)
