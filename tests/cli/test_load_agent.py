"""`kvctl load`, `/v1/tokenize` and the pool's sizing against real agents on the demo model."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from agent_process import RunningAgent, launch_agent

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def short_agent() -> Iterator[RunningAgent]:
    """A pool of 1,024 tokens, a quarter of the demo model's 4,096-token context."""
    running = launch_agent("--pool-pages", "64", "--segment-pages", "32", "--page-size", "16")
    yield running
    running.stop()


def test_tokenize_counts_as_completions_do(agent) -> None:
    with httpx.Client(base_url=agent.url, timeout=60) as http:
        answer = http.post("/v1/tokenize", json={"prompt": ["héllo", "page pool"]}).json()
        assert answer["max_model_len"] == 4096
        assert [r["count"] for r in answer["results"]] == [7, 10]  # bytes + BOS
        assert answer["results"][0]["tokens"] == [256, 104, 195, 169, 108, 108, 111]
        bare = {"prompt": "héllo", "add_special_tokens": False, "return_token_ids": False}
        assert http.post("/v1/tokenize", json=bare).json()["results"] == [
            {"count": 6, "tokens": None}
        ]
        completion = http.post("/v1/completions", json={"prompt": "héllo", "max_tokens": 1})
        assert completion.json()["usage"]["prompt_tokens"] == 7
        other = http.post("/v1/tokenize", json={"prompt": "x", "model": "nope"})
        assert other.status_code == 404 and "not served here" in other.json()["error"]["message"]
        too_many = http.post("/v1/tokenize", json={"prompt": ["x"] * 257})
        assert too_many.status_code == 422


def test_load_sizes_prompts_in_tokens_and_picks_the_endpoint(agent, kvctl) -> None:
    with httpx.Client(base_url=agent.url, timeout=60) as http:
        capabilities = http.get("/v1/models").json()["data"][0]["capabilities"]
    result = kvctl(
        "load", "--profile", "random-lengths", "--requests", "4", "--max-tokens", "4",
        "--json", "-a", agent.url,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["requests"]["completed"] == 4
    if "chat" in capabilities:
        assert report["endpoint"] == "/v1/chat/completions"
    else:
        assert report["endpoint"] == "/v1/completions"
        assert "no chat template: sending text prompts to /v1/completions" in result.stderr
    # random-lengths: 8 to 1,500 tokens (seed 0 starts with a few hundred), BOS included
    assert 8 < report["prompt_tokens"]["p50"] <= report["prompt_tokens"]["max"] <= 1501
    assert report["tokens"]["prompt"] >= 4 * 8


def test_start_up_logs_the_pool_and_warns_below_the_context(short_agent) -> None:
    lines = "\n".join(short_agent.log)
    assert (
        "pool: 64 pages of 16 tokens, 64 KiB each (4 MiB): 1,024 tokens; largest request 1,024 "
        "tokens (prompt + max_tokens, the pool)"
    ) in lines
    warning = next(line for line in short_agent.log if "level=WARNING" in line)
    assert "fewer than the model's context of 4,096" in warning
    assert "--pool-pages 256 or --pool-memory 16MiB" in warning


def test_pool_show_gives_sizing_advice(short_agent, kvctl) -> None:
    result = kvctl("pool", "show", "-a", short_agent.url, "--requests", "2")
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert "1,024 tokens, 0 requests of the full 4,096-token context" in out
    assert "1,024 tokens (prompt + max_tokens; the pool)" in out
    assert "2 full contexts at once: 512 pages (32 MiB); kvctl pool resize --pages 512" in out
    as_json = json.loads(kvctl("pool", "show", "--json", "-a", short_agent.url).stdout)
    assert as_json["capacity_pages"] == 64 and "holds" not in as_json


def test_long_context_prompts_fit_the_pool_of_a_small_agent(short_agent, kvctl) -> None:
    """long-context sizes prompts to the model's context; on a pool below it they are refused
    with the resize that makes room, never sent blindly and miscounted."""
    result = kvctl(
        "load", "-p", "long-context", "-n", "2", "--max-tokens", "2", "--json", "-a",
        short_agent.url,
    )  # fmt: skip
    report = json.loads(result.stdout)
    assert report["requests"]["failed"] == 2
    assert all("resize" in message for message in report["errors"])
