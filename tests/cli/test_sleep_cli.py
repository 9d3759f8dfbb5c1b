"""`kvctl sleep` and `kvctl wake` against a real agent serving two models under one KV budget:
a sleep gives the model's pool back to the budget (its capacity reads 0), a request for it wakes
it and gets the tokens it got before, at both levels; the wake is counted and timed in the
metrics; the last awake model, a model with requests, an unknown model are one line each that
change nothing."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from agent_process import RunningAgent, launch_agent
from metric_samples import kvctl_samples

from kvctl.api import PoolList
from kvctl.cli.options import ExitCode

pytestmark = pytest.mark.integration

TWO_MODELS = ("--model", "small=demo", "--model", "big=demo:8x4")
TWO_POOLS = ("--pool-pages", "64", "--segment-pages", "16")
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 12}
MIB = 2**20


@pytest.fixture(scope="module")
def two_models() -> Iterator[RunningAgent]:
    running = launch_agent(*TWO_MODELS, *TWO_POOLS)
    yield running
    running.stop()


def pools(url: str) -> dict:
    listing = PoolList.model_validate(httpx.get(f"{url}/v1/pools", timeout=30).json())
    return {pool.pool: pool for pool in listing.pools}


def complete(url: str, model: str) -> list[str]:
    body = {"model": model, "prompt": "the pool of pages", **GREEDY}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return [choice["text"] for choice in answer.json()["choices"]]


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def metric(url: str, name: str, **labels: str) -> float:
    samples = kvctl_samples(httpx.get(f"{url}/metrics", timeout=30).text)
    return samples[(name, frozenset(labels.items()))]


@pytest.mark.parametrize("level", ["1", "2"])
def test_a_sleeping_model_gives_its_pool_back_and_a_request_wakes_it(
    kvctl, two_models, level
) -> None:
    url = two_models.url
    before = complete(url, "big")
    assigned = pools(url)["big"].share
    assert assigned is not None
    result = kvctl("-a", url, "sleep", "--model", "big", "--level", level, "--yes")
    assert result.exit_code == 0, result.output
    weights = " of weights dropped" if level == "2" else ""
    assert f"model big: asleep (level {level}): 8 MiB of KV released" in result.stdout
    assert weights in result.stdout
    big = pools(url)["big"]
    assert big.capacity_pages == 0 and big.sleep.state == "asleep"
    assert big.share is not None
    assert big.share.assigned_bytes == assigned.assigned_bytes - 8 * MIB
    status = kvctl("-a", url, "sleep", "--status")
    assert status.exit_code == 0
    assert f"model big: asleep (level {level}," in status.stdout
    assert "model small: awake" in status.stdout
    woken = metric(url, "kvctl_model_wakes_total", pool="big", trigger="request")
    assert complete(url, "big") == before
    big = pools(url)["big"]
    assert big.sleep.state == "awake" and big.capacity_pages == 64
    assert metric(url, "kvctl_model_wakes_total", pool="big", trigger="request") == woken + 1
    assert metric(url, "kvctl_model_wake_seconds_count", pool="big") >= 1


def test_kvctl_wake_answers_once_the_model_can_serve(kvctl, two_models) -> None:
    url = two_models.url
    assert kvctl("-a", url, "sleep", "--model", "big", "--level", "2", "--yes").exit_code == 0
    result = kvctl("-a", url, "wake", "--model", "big", "--timeout", "120")
    assert result.exit_code == 0, result.output
    assert "model big: awake in " in result.stdout and "weights reloaded" in result.stdout
    assert pools(url)["big"].sleep.state == "awake"
    again = kvctl("-a", url, "wake", "--model", "big")
    assert again.exit_code == 0 and "model big: awake already" in again.stdout


def test_the_last_awake_model_sleeps_only_when_forced(kvctl, two_models) -> None:
    url = two_models.url
    assert kvctl("-a", url, "sleep", "--model", "big", "--yes").exit_code == 0
    refused = kvctl("-a", url, "sleep", "--model", "small", "--yes")
    assert refused.exit_code != 0
    assert "is the last awake model of this agent" in one_line(refused.stderr)
    assert pools(url)["small"].sleep.state == "awake"
    forced = kvctl("-a", url, "sleep", "--model", "small", "--yes", "--force")
    assert forced.exit_code == 0, forced.output
    assert complete(url, "small") and complete(url, "big")  # each request wakes its model
    assert {name: p.sleep.state for name, p in pools(url).items()} == {
        "small": "awake",
        "big": "awake",
    }


def test_refusals_are_one_line_and_change_nothing(kvctl, two_models) -> None:
    url = two_models.url
    unknown = kvctl("-a", url, "sleep", "--model", "nope", "--yes")
    assert unknown.exit_code != 0 and "'nope' is not served here" in one_line(unknown.stderr)
    several = kvctl("-a", url, "sleep", "--yes")
    assert several.exit_code != 0 and "serves several models" in one_line(several.stderr)
    asleep = kvctl("-a", url, "sleep", "--model", "big", "--yes")
    assert asleep.exit_code == 0
    again = kvctl("-a", url, "sleep", "--model", "big", "--level", "2", "--yes")
    assert again.exit_code != 0 and "already asleep at level 1" in one_line(again.stderr)
    bad = httpx.post(f"{url}/v1/pools/big/sleep", json={"level": 3}, timeout=30)
    assert bad.status_code == 422
    assert pools(url)["big"].sleep.level == 1
    assert kvctl("-a", url, "wake", "--model", "big").exit_code == 0
    cancelled = kvctl("-a", url, "sleep", "--model", "big", input="n\n")
    assert cancelled.exit_code == ExitCode.CANCELLED
    assert pools(url)["big"].sleep.state == "awake"
