"""Floods of idle connections against a real agent: probes and requests keep being answered,
and a file limit too small for the connection limit neither starves them nor floods the log."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.agent_process import SMALL_POOL, RunningAgent

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def idle_connections(agent: RunningAgent, count: int) -> Iterator[list[socket.socket]]:
    """`count` connections to the agent that send nothing, all open at once."""
    address = (urlsplit(agent.url).hostname, urlsplit(agent.url).port)
    opened: list[socket.socket] = []
    try:
        for _ in range(count):
            opened.append(socket.create_connection(address, timeout=5))
        time.sleep(0.3)  # the agent has accepted them all
        yield opened
    finally:
        for sock in opened:
            sock.close()


def answers(agent: RunningAgent) -> list[int]:
    """Statuses of /healthz and a small completion, each on a new connection."""
    with httpx.Client(base_url=agent.url, timeout=5) as http:
        health = http.get("/healthz").status_code
    with httpx.Client(base_url=agent.url, timeout=15) as http:
        body = {"model": "demo", "prompt": "hello", "max_tokens": 2}
        completion = http.post("/v1/completions", json=body).status_code
    return [health, completion]


def test_idle_connections_up_to_and_past_the_limit_leave_requests_answered(tmp_path, start_agent):
    """At exactly `max_connections` idle connections a new request used to get 503 (the
    server's own limit counted one more connection than the idle-connection limit closed)."""
    config = tmp_path / "agent.toml"
    config.write_text("max_connections = 32\n")
    agent = start_agent("--config", str(config), *SMALL_POOL)
    for count in (31, 32, 33, 96):
        with idle_connections(agent, count):
            assert answers(agent) == [200, 200], f"{count} idle connections"


def test_a_file_limit_below_the_connection_limit_is_fitted_and_quiet(start_agent):
    """With 256 descriptors and the default 2,048 connections, `accept()` used to fail first:
    probes timed out and asyncio logged a traceback for every attempt."""
    agent = start_agent(*SMALL_POOL, file_limit=256)
    before = len(agent.log)
    with idle_connections(agent, 400):
        assert answers(agent) == [200, 200]
    time.sleep(0.5)
    flood = agent.log[before:]
    assert not any("Traceback" in line for line in flood), flood[:20]
    assert len(flood) < 20, flood[:20]
    assert any("max_connections 2048 lowered to" in line for line in agent.log)


def churn(agent: RunningAgent, stop: threading.Event, held: int, seconds: float) -> int:
    """Reconnect as fast as possible, keeping `held` idle connections open (the oldest closed
    as each new one opens), until `stop` or `seconds`; how many connections it opened."""
    address = (urlsplit(agent.url).hostname, urlsplit(agent.url).port)
    opened: collections.deque[socket.socket] = collections.deque()
    count = 0
    deadline = time.monotonic() + seconds
    try:
        while not stop.is_set() and time.monotonic() < deadline and count < 200_000:
            with contextlib.suppress(OSError):  # a full accept queue: try again
                opened.append(socket.create_connection(address, timeout=0.2))
                count += 1
            while len(opened) > held:
                opened.popleft().close()
    finally:
        for sock in opened:
            sock.close()
    return count


def ask(request: Callable[[], httpx.Response], what: str) -> list[str]:
    """What went wrong with `request`: nothing, or one line."""
    try:
        status = request().status_code
    except httpx.TransportError as error:
        return [f"{what}: {error!r}"]
    return [] if status == 200 else [f"{what}: {status}"]


def test_a_connection_churn_flood_resets_no_request_and_no_keep_alive_scrape(tmp_path, start_agent):
    """Under reconnects as fast as a client can make them, past `max_connections`, probes on
    new connections and a scraper's keep-alive connection used to be reset now and then:
    closed to make room while their request still waited in the socket buffer, or, answered
    and idle, before the flood's never-used connections."""
    config = tmp_path / "agent.toml"
    config.write_text("max_connections = 256\n")
    agent = start_agent("--config", str(config), *SMALL_POOL)
    stop = threading.Event()
    failures: list[str] = []
    with (
        concurrent.futures.ThreadPoolExecutor(3) as flood,
        httpx.Client(base_url=agent.url, timeout=10) as scraper,
    ):
        churners = [flood.submit(churn, agent, stop, 100, 60.0) for _ in range(3)]
        time.sleep(0.5)
        try:
            for probe in range(48):
                path = "/healthz" if probe % 2 else "/v1/models"
                failures += ask(lambda url=agent.url + path: httpx.get(url, timeout=10), path)
                failures += ask(lambda: scraper.get("/metrics"), "/metrics (keep-alive)")
            flooding = not any(churner.done() for churner in churners)
        finally:
            stop.set()
        connects = sum(churner.result() for churner in churners)
    assert flooding, f"the flood ended before the probes did ({connects} connects)"
    assert failures == [], f"{len(failures)} of 96 failed with {connects} connects: {failures}"
