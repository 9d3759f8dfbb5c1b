"""Load profiles are a function of the seed; the runner is bounded and measures what it sent."""

from __future__ import annotations

import asyncio
import itertools
import json
import random

import pytest

from kvctl.api import CompletionResponse
from kvctl.client import AgentUnreachable
from kvctl.load.profiles import PROFILES, SYSTEM_PROMPT, Burst, generate
from kvctl.load.report import LoadReport, RequestResult, percentile
from kvctl.load.runner import LoadRun, LoadSettings


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_same_seed_same_requests(name) -> None:
    assert generate(name, seed=7, max_tokens=16, count=20) == generate(name, 7, 16, 20)
    assert generate(name, 7, 16, 20) != generate(name, 8, 16, 20)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_requests_respect_max_tokens(name) -> None:
    for request in generate(name, seed=1, max_tokens=24, count=50):
        assert 1 <= request.max_tokens <= 24
        assert request.prompt


def test_chat_turns_extend_the_conversation() -> None:
    requests = generate("chat", seed=3, max_tokens=8, count=60)
    assert all(r.prompt.startswith(SYSTEM_PROMPT) for r in requests)
    by_chat: dict[int, list] = {}
    for request in requests:
        by_chat.setdefault(request.conversation, []).append(request)
    follow_ups = 0
    for turns in by_chat.values():
        for before, after in itertools.pairwise(turns):
            if after.turn == before.turn + 1:
                # the next turn repeats the whole previous prompt, minus its "Assistant:" cue
                assert after.prompt.startswith(before.prompt.removesuffix("Assistant:"))
                follow_ups += 1
    assert follow_ups > 20


def test_long_context_prompts_are_long() -> None:
    assert all(len(r.prompt) >= 1500 for r in generate("long-context", 0, 8, 10))


def test_burst_arrivals_come_in_groups() -> None:
    gaps = list(itertools.islice(Burst().gaps(random.Random(0), rate=8.0), 48))
    assert [i for i, gap in enumerate(gaps) if gap > 0] == [16, 32]
    assert all(1.8 <= gaps[i] <= 2.2 for i in (16, 32))  # 16 requests / 8 per second, ±10 %


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)


def test_report_json_keys_and_counts() -> None:
    results = (
        RequestResult(0, latency=0.5, ttft=0.1, prompt_tokens=10, completion_tokens=4),
        RequestResult(1, 1.5, 0.3, prompt_tokens=20, cached_tokens=8, completion_tokens=4),
        RequestResult(2, latency=0.2, error="agent x: boom"),
        RequestResult(3, latency=0.0, cancelled=True),
    )  # fmt: skip
    data = LoadReport("chat", 0, "closed", None, 2, 2.0, results).to_json()
    assert set(data) == {
        "profile", "seed", "endpoint", "mode", "rate", "concurrency", "duration_s",
        "stopped_by", "requests", "ttft_s", "latency_s", "prompt_tokens", "tokens",
        "output_tokens_per_s", "requests_per_s", "errors",
    }  # fmt: skip
    assert data["endpoint"] == "/v1/completions"
    assert data["prompt_tokens"]["p50"] == 15 and data["prompt_tokens"]["max"] == 20
    assert data["requests"] == {"sent": 4, "completed": 2, "failed": 1, "cancelled": 1}
    assert data["tokens"] == {"prompt": 30, "cached_prompt": 8, "output": 8}
    assert data["latency_s"]["p50"] == 1.0 and data["latency_s"]["max"] == 1.5
    assert data["output_tokens_per_s"] == 4.0
    assert data["errors"] == {"agent x: boom": 1}


def test_cached_tokens_the_agent_does_not_report_are_unknown_not_zero() -> None:
    unreported = tuple(RequestResult(i, 0.5, 0.1, cached_tokens=None) for i in range(3))
    data = LoadReport("chat", 0, "closed", None, 2, 2.0, unreported).to_json()
    assert data["tokens"]["cached_prompt"] is None


class FakeClient:
    """Streams `tokens` one-token chunks per request after `delay` seconds; records prompts."""

    url = "http://fake"

    def __init__(self, tokens: int = 3, delay: float = 0.0, fail: bool = False) -> None:
        self.tokens, self.delay, self.fail = tokens, delay, fail
        self.prompts: list[str] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def stream_completion(self, request):
        self.prompts.append(request.prompt)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if self.fail:
                raise AgentUnreachable(self.url, "cannot reach agent at http://fake")
            for index in range(self.tokens):
                yield CompletionResponse(
                    id="c", created=0, model="demo",
                    choices=[{"text": "x", "finish_reason": None, "token_ids": [index]}],
                )  # fmt: skip
        finally:
            self.in_flight -= 1


def run(client: FakeClient, **settings) -> LoadReport:
    return asyncio.run(LoadRun(client, LoadSettings(**settings)).run())  # type: ignore[arg-type]


def test_closed_loop_stops_at_the_request_count_with_the_profiles_prompts() -> None:
    client = FakeClient(delay=0.001)
    report = run(client, profile="random-lengths", requests=10, concurrency=3, seed=5)
    assert len(report.completed) == 10
    assert report.output_tokens == 30
    assert client.most_in_flight == 3
    expected = [r.prompt for r in generate("random-lengths", 5, 32, 10)]
    assert sorted(client.prompts) == sorted(expected)


def test_open_loop_caps_in_flight_and_stops_at_the_duration() -> None:
    client = FakeClient(delay=0.05)
    report = run(client, profile="chat", rate=200.0, concurrency=2, duration=0.3, drain=1.0)
    assert report.mode == "open" and report.rate == 200.0
    assert client.most_in_flight <= 2
    assert 2 <= len(report.results) < 60  # at most 0.3 s of sends at 2 in flight
    assert report.duration_s < 1.5


def test_requests_still_running_after_the_drain_are_cancelled() -> None:
    report = run(FakeClient(delay=5.0), profile="chat", duration=0.1, drain=0.1, concurrency=2)
    assert report.cancelled == 2 and not report.completed
    assert report.duration_s < 1.0


def test_errors_are_counted_by_message() -> None:
    report = run(FakeClient(fail=True), profile="burst", requests=4, rate=1000.0)
    assert report.failed == 4
    assert report.errors() == {"cannot reach agent at http://fake": 4}


@pytest.mark.parametrize("rate", [None, 100.0])
def test_a_stopped_run_reports_what_it_did(rate) -> None:
    """`stop` (a signal) ends the run at once: no new requests, in-flight ones counted as
    cancelled, and the report of what happened so far."""

    async def go() -> LoadReport:
        client = FakeClient(delay=0.05)
        settings = LoadSettings(profile="chat", duration=30.0, concurrency=2, rate=rate)
        load = LoadRun(client, settings)  # type: ignore[arg-type]
        task = asyncio.create_task(load.run())
        await asyncio.sleep(0.3)
        load.stop("SIGTERM")
        return await task

    report = asyncio.run(go())
    assert report.stopped_by == "SIGTERM"
    assert report.duration_s < 5.0
    assert len(report.completed) >= 2
    assert report.cancelled >= 1
    assert report.to_json()["stopped_by"] == "SIGTERM"


def test_profiles_are_listed_without_an_agent(kvctl) -> None:
    result = kvctl("load", "--list-profiles", "-a", "http://127.0.0.1:9")  # nothing listens
    assert result.exit_code == 0, result.output
    for profile in PROFILES.values():
        assert profile.name in result.stdout and profile.summary in result.stdout
    listed = json.loads(kvctl("load", "--list-profiles", "--json").stdout)["profiles"]
    assert [row["profile"] for row in listed] == list(PROFILES)
