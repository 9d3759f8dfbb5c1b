"""Bodies that used to crash a handler (a 500 and a traceback): text with a lone surrogate, which
has no UTF-8 form, token ids outside the vocabulary with `echo`, and JSON nested past the stack;
and texts too long to be a prompt, which /v1/tokenize used to tokenize, holding the GIL for most
of a second per megabyte. Each is a 400 in OpenAI's error shape naming the field, and leaves the
agent as it was: settings, pages and counters unchanged, and the next ordinary request served.

The bodies are sent as raw bytes: a JSON `\\ud800` escape decodes to a lone surrogate, which no
client library would encode for us."""

from __future__ import annotations

import time

import httpx
import pytest
from agent_process import SMALL_POOL, launch_agent

from kvctl.agent.http.server import json_depth

pytestmark = pytest.mark.integration

DEEP = 100_000
SURROGATE = "(\\ud800) at index 1; send valid UTF-8"


@pytest.fixture(scope="module")
def agent():
    running = launch_agent(*SMALL_POOL)
    yield running
    running.stop()


def state(http: httpx.Client) -> tuple:
    """What a refused request must not change: the settings, the pages, and every counter that
    says a request was queued, admitted, computed or served."""
    pool = http.get("/v1/pool").json()
    served = (
        "alloc_attempts_total",
        "used_pages",
        "requests_running",
        "requests_waiting",
        "requests_finished_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "prefix_queries_tokens_total",
        "admin_actions_total",
    )
    return (
        http.get("/v1/config").json(),
        http.get("/v1/pool/map").json()["runs"],
        {name: pool[name] for name in served},
    )


def settled(http: httpx.Client, timeout: float = 10.0) -> tuple:
    """`state` once snapshots (published every 100 ms) stop changing and nothing runs."""
    deadline = time.monotonic() + timeout
    last = state(http)
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = state(http)
        if now == last and not now[2]["requests_running"] and not now[2]["requests_waiting"]:
            return now
        last = now
    raise AssertionError(f"the agent did not settle within {timeout} s: {last}")


def post(http: httpx.Client, method: str, path: str, body: bytes) -> httpx.Response:
    return http.request(method, path, content=body, headers={"content-type": "application/json"})


def assert_refused(response: httpx.Response, message: str, param: str | None) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert message in error["message"], error["message"]
    assert error["param"] == param


DEMO_TEXT_LIMIT = 65536
"""16 bytes per token of the demo model's 4096-token context."""
TOO_LONG = b"x" * (DEMO_TEXT_LIMIT + 1)
TOO_LONG_MESSAGE = f"is {DEMO_TEXT_LIMIT + 1} bytes, over this agent's limit of {DEMO_TEXT_LIMIT}"

CASES = [
    pytest.param(
        "POST",
        "/v1/tokenize",
        b'{"prompt": "' + TOO_LONG + b'"}',
        f"prompt: the prompt {TOO_LONG_MESSAGE}",
        "prompt",
        id="tokenize-too-long",
    ),
    pytest.param(
        "POST",
        "/v1/tokenize",
        b'{"prompt": ["ok", "' + TOO_LONG + b'"]}',
        f"prompt.1: the prompt {TOO_LONG_MESSAGE}",
        "prompt.1",
        id="tokenize-batch-too-long",
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "' + TOO_LONG + b'"}], "max_tokens": 2}',
        f"over this agent's limit of {DEMO_TEXT_LIMIT}",
        None,
        id="chat-too-long",
    ),
    pytest.param(
        "POST",
        "/v1/completions",
        b'{"prompt": "a\\ud800b", "max_tokens": 2}',
        f"prompt: text contains a lone surrogate {SURROGATE}",
        "prompt",
        id="completion-prompt",
    ),
    pytest.param(
        "POST",
        "/v1/completions",
        b'{"prompt": ["ok", "a\\udc00"], "max_tokens": 2}',
        "prompt.1: text contains a lone surrogate (\\udc00) at index 1",
        "prompt.1",
        id="completion-prompt-list",
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
        f"messages.0.content: text contains a lone surrogate {SURROGATE}",
        "messages.0.content",
        id="chat-content",
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud800"}]}]}',
        f"messages.0.content.0.text: text contains a lone surrogate {SURROGATE}",
        "messages.0.content.0.text",
        id="chat-content-part",
    ),
    pytest.param(
        "POST",
        "/v1/tokenize",
        b'{"prompt": "a\\ud800b"}',
        f"prompt: text contains a lone surrogate {SURROGATE}",
        "prompt",
        id="tokenize",
    ),
    pytest.param(
        "POST",
        "/v1/tokenize",
        b'{"prompt": ["fine", "a\\ud800b"]}',
        f"prompt.1: text contains a lone surrogate {SURROGATE}",
        "prompt.1",
        id="tokenize-batch",
    ),
    pytest.param(
        "POST",
        "/v1/completions",
        b'{"prompt": [1, 2, 99999], "echo": true, "max_tokens": 2}',
        "prompt: token id 99999 at index 2 is outside the model's vocabulary of 258 tokens",
        "prompt",
        id="echo-out-of-vocabulary",
    ),
    pytest.param(
        "POST",
        "/v1/completions",
        b'{"prompt": [[1, 2], [3, 258]], "max_tokens": 2}',
        "prompt.1: token id 258 at index 1 is outside the model's vocabulary of 258 tokens",
        "prompt.1",
        id="out-of-vocabulary-in-a-list",
    ),
    pytest.param(
        "PATCH",
        "/v1/config",
        b'{"a":' * DEEP + b"1" + b"}" * DEEP,
        "the body nests arrays and objects more than 64 levels deep",
        None,
        id="config-deep-nesting",
    ),
    pytest.param(
        "POST",
        "/v1/completions",
        b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}",
        "the body nests arrays and objects more than 64 levels deep",
        None,
        id="completion-deep-nesting",
    ),
    pytest.param(
        "POST",
        "/v1/pool/resize",
        b"[" * DEEP + b"]" * DEEP,
        "the body nests arrays and objects more than 64 levels deep",
        None,
        id="resize-deep-nesting",
    ),
    pytest.param(
        "PATCH",
        "/v1/config",
        b'{"\\ud800": {}}',
        "body: a key contains a lone surrogate (\\ud800) at index 0",
        "body",
        id="config-section-name",
    ),
    pytest.param(
        "PATCH",
        "/v1/config",
        b'{"defrag": {"a\\ud800": true}}',
        f"defrag: a key contains a lone surrogate {SURROGATE}",
        "defrag",
        id="config-setting-name",
    ),
    pytest.param(
        "POST",
        "/v1/completions",
        b'{"prompt": "x", "stop": ["fine", "a\\ud800"], "max_tokens": 2}',
        f"stop.1: text contains a lone surrogate {SURROGATE}",
        "stop.1",
        id="stop-string",
    ),
    pytest.param(
        "POST",
        "/v1/completions",
        b'{"prompt": "x", "logit_bias": {"\\ud800": 1}, "max_tokens": 2}',
        "logit_bias: a key contains a lone surrogate (\\ud800) at index 0",
        "logit_bias",
        id="logit-bias-key",
    ),
    pytest.param(
        "POST",
        "/v1/completions",
        b'{"prompt": "x", "model": "d\\ud800", "max_tokens": 2}',
        f"model: text contains a lone surrogate {SURROGATE}",
        "model",
        id="model-name",
    ),
    pytest.param(
        "POST",
        "/v1/completions",
        b'{"prompt": "x", "cache_salt": "t\\ud800", "max_tokens": 2}',
        f"cache_salt: text contains a lone surrogate {SURROGATE}",
        "cache_salt",
        id="cache-salt",
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x", "name": "a\\ud800"}]}',
        f"messages.0.name: text contains a lone surrogate {SURROGATE}",
        "messages.0.name",
        id="chat-name",
    ),
    pytest.param(
        "POST",
        "/v1/completions",
        b'{"prompt": "x", "a\\ud800": 1}',
        f"body: a key contains a lone surrogate {SURROGATE}",
        "body",
        id="unknown-field-name",
    ),
]


@pytest.mark.parametrize(("method", "path", "body", "message", "param"), CASES)
def test_a_hostile_body_is_a_400_that_changes_nothing(
    agent, method: str, path: str, body: bytes, message: str, param: str | None
) -> None:
    logged = len(agent.log)
    with httpx.Client(base_url=agent.url, timeout=60) as http:
        before = settled(http)
        assert_refused(post(http, method, path, body), message, param)
        assert settled(http) == before
        served = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})
        assert served.status_code == 200, served.text
    assert not [line for line in agent.log[logged:] if "Traceback" in line]


def test_a_surrogate_pair_ordinary_nesting_and_the_longest_text_are_served(agent) -> None:
    """An escaped pair is one character (an emoji), nesting that bodies need is fine, and a
    text of exactly the byte limit is tokenized."""
    with httpx.Client(base_url=agent.url, timeout=60) as http:
        pair = post(http, "POST", "/v1/tokenize", b'{"prompt": "\\ud83d\\ude00"}')
        assert pair.status_code == 200 and pair.json()["results"][0]["count"] == 1 + 4
        nested = {"prompt": [[1, 2]], "max_tokens": 1, "response_format": {"type": "text"}}
        assert http.post("/v1/completions", json=nested).status_code == 200
        escaped = {"prompt": "[" * 100 + '"\\' + "{" * 100}  # brackets in a string are text
        assert http.post("/v1/tokenize", json=escaped).status_code == 200
        longest = http.post("/v1/tokenize", json={"prompt": "x" * DEMO_TEXT_LIMIT})
        assert (
            longest.status_code == 200
            and longest.json()["results"][0]["count"] == 1 + DEMO_TEXT_LIMIT
        )


@pytest.mark.parametrize(
    ("body", "depth"),
    [
        (b"[" * 65 + b"]" * 65, 65),
        (b'{"a": [1, {"b": [2]}]}', 0),  # under the limit's count of brackets: not scanned
        (b'["' + b"[" * 100 + b'"]', 1),  # brackets inside a string are text
        (b'["\\"' + b"{" * 100 + b'", [[]]]', 3),  # an escaped quote does not end the string
        (b'["\\\\"' + b", [" * 70 + b"]" * 70 + b"]", 71),  # an escaped backslash does
        (b"[" * 70 + b'"\\"' * 1000, 70),  # an unterminated string runs to the end
    ],
)
def test_nesting_is_measured_on_the_raw_bytes(body: bytes, depth: int) -> None:
    assert json_depth(body) == depth
