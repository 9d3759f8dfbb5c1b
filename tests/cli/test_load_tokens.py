"""`kvctl load` sizes prompts in the model's tokens and speaks chat when the model has it."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from kvctl.api import TokenizedText, TokenizeRequest, TokenizeResponse
from kvctl.client import AsyncAgentClient
from kvctl.load.profiles import SYSTEM_PROMPT, generate
from kvctl.load.runner import LoadRun, LoadSettings
from kvctl.load.setup import LoadPlan, prepare, supports_chat
from kvctl.load.tokens import WORDS, Lexicon, TokenCounter


class FakeTokenizer:
    """Counts 2 tokens per word and 1 per other piece; records each call's batch."""

    def __init__(self, context: int = 2048) -> None:
        self.context = context
        self.batches: list[list[str]] = []

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        texts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        self.batches.append(texts)
        counts = [sum(2 if w in WORDS else 1 for w in t.split()) for t in texts]
        results = [TokenizedText(count=c) for c in counts]
        return TokenizeResponse(model="m", max_model_len=self.context, results=results)


def test_counter_batches_and_caches_by_text() -> None:
    fake = FakeTokenizer()
    counter = TokenCounter(fake, batch=10)
    texts = [f"a {w}" for w in WORDS]  # 25 texts
    assert asyncio.run(counter.counts(texts)) == [3] * len(WORDS)
    assert [len(b) for b in fake.batches] == [10, 10, 5]
    assert asyncio.run(counter.counts([*texts, texts[0]])) == [3] * (len(WORDS) + 1)
    assert counter.calls == 3  # all cached


def test_lexicon_costs_come_from_the_agent_in_one_call() -> None:
    fake = FakeTokenizer(context=1024)
    lexicon = asyncio.run(Lexicon.counted(TokenCounter(fake)))
    assert len(fake.batches) == 1
    assert set(lexicon.costs.values()) == {2} and lexicon.context == 1024
    text = lexicon.text(random.Random(0), 100)
    assert 100 <= 2 * len(text.split()) < 102


@pytest.mark.parametrize("name", ["chat", "random-lengths", "long-context", "burst"])
def test_prompts_fit_a_small_context(name: str) -> None:
    lexicon = Lexicon.bytes(context=512)
    for request in generate(name, seed=2, max_tokens=32, count=40, lexicon=lexicon):
        assert len(request.prompt.encode()) + 1 + request.max_tokens <= 512, name


def test_long_context_scales_with_the_context() -> None:
    for context in (2048, 8192):
        lengths = [
            len(r.prompt) for r in generate("long-context", 0, 16, 20, Lexicon.bytes(context))
        ]
        assert context * 3 // 8 <= min(lengths) and max(lengths) <= context * 3 // 4 + 12


def test_chat_requests_are_conversations() -> None:
    for request in generate("chat", seed=3, max_tokens=8, count=30):
        roles = [role for role, _ in request.chat]
        assert roles[0] == "system" and roles[-1] == "user"
        assert roles[1:] == ["user", "assistant"] * (len(roles) // 2 - 1) + ["user"]
        assert request.chat[0][1] == SYSTEM_PROMPT.strip()
        assert request.prompt.endswith(f"User: {request.chat[-1][1]}\nAssistant:")


class FakeChatClient:
    """Streams chat chunks: `tokens` one-token deltas, then usage; records the messages."""

    url = "http://fake"

    def __init__(self, tokens: int = 3) -> None:
        self.tokens = tokens
        self.conversations: list[list[dict]] = []

    async def stream_chat(self, request):
        self.conversations.append([m.model_dump() for m in request.messages])
        for index in range(self.tokens):
            yield {"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [index]}]}
        usage = {"prompt_tokens": 40, "completion_tokens": self.tokens, "total_tokens": 43}
        yield {"choices": [], "usage": usage}


def test_a_chat_plan_sends_messages_and_reports_tokens() -> None:
    client = FakeChatClient()
    run = LoadRun(client, LoadSettings(requests=5, concurrency=1), plan=LoadPlan(chat=True))  # type: ignore[arg-type]
    report = asyncio.run(run.run())
    data = report.to_json()
    assert data["endpoint"] == "/v1/chat/completions"
    assert data["requests"]["completed"] == 5 and data["tokens"]["output"] == 15
    assert data["prompt_tokens"]["max"] == 40
    assert all(c[0]["role"] == "system" for c in client.conversations)


def _agent(models: dict, chat_status: int, tokenize: bool = True) -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models)
        if request.url.path == "/v1/chat/completions":
            if chat_status != 200:
                error = {"message": "no", "type": "invalid_request_error", "code": chat_status}
                return httpx.Response(chat_status, json={"error": error})
            return httpx.Response(200, text='data: {"choices": []}\n\ndata: [DONE]\n\n')
        if request.url.path == "/v1/tokenize" and tokenize:
            texts = json.loads(request.content)["prompt"]
            results = [{"count": len(t.encode())} for t in texts]
            return httpx.Response(
                200, json={"model": "m", "max_model_len": 999, "results": results}
            )
        error = {"message": "Not Found", "type": "not_found", "code": 404}
        return httpx.Response(404, json={"error": error})

    return httpx.MockTransport(answer)


def _card(**fields) -> dict:
    return {"data": [{"id": "m", "created": 0, **fields}]}


@pytest.mark.parametrize(
    ("models", "chat_status", "expected"),
    [
        (_card(capabilities=["completions", "chat"]), 404, True),  # listed: no probe
        (_card(capabilities=["completions"]), 200, False),
        (_card(), 200, True),  # not listed: the probe answers
        (_card(), 404, False),
        (_card(), 400, False),
    ],
)
def test_chat_support_from_capabilities_or_a_probe(models, chat_status, expected) -> None:
    async def go() -> bool:
        async with AsyncAgentClient("http://x", transport=_agent(models, chat_status)) as client:
            return await supports_chat(client)

    assert asyncio.run(go()) is expected


def test_plan_falls_back_with_notices() -> None:
    async def go(tokenize: bool) -> LoadPlan:
        transport = _agent(_card(max_model_len=777), 404, tokenize)
        async with AsyncAgentClient("http://x", transport=transport) as client:
            return await prepare(client)

    counted = asyncio.run(go(True))
    assert not counted.chat and counted.lexicon.context == 999
    assert counted.lexicon.costs["page"] == 5  # len("a page") - len("a")
    assert counted.notices == ("the model has no chat template: sending text prompts to "
                               "/v1/completions",)  # fmt: skip
    estimated = asyncio.run(go(False))
    assert estimated.lexicon.context == 777
    assert "one token per byte" in estimated.notices[1]
