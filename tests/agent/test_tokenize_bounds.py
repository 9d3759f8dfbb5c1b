"""A text is bounded before it is tokenized, on every route that tokenizes one: /v1/tokenize
and chat refuse a text longer than 16 bytes per token of the prompt limit without calling the
tokenizer (completions: test_pressure.py), and all of them tokenize under one lock, one text at a
time. A 1 MB text held the GIL for most of a second, stalling /healthz and every stream beside
it.

The handlers are called alone with a tokenizer that records its calls, so "never tokenized" is
observed, not inferred from timing."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from kvctl.agent.chat_prompt import prompt_ids
from kvctl.agent.config import AgentConfig
from kvctl.agent.generation import MAX_BYTES_PER_TOKEN, Generation, Refusal
from kvctl.agent.http.audit import AuditLog
from kvctl.agent.http.context import ApiError, ServerContext
from kvctl.agent.http.routes import tokenize
from kvctl.agent.model.chat_template import ChatTemplate
from kvctl.agent.model.tokenizer import ByteTokenizer, Span
from kvctl.agent.observe.tally import Tally
from kvctl.agent.served import ServedModel
from kvctl.api import ChatCompletionRequest, RuntimeSettings, TokenizeRequest

CONTEXT = 4096  # under max_prompt_tokens (8192): the model's context is the prompt limit
LIMIT = CONTEXT * MAX_BYTES_PER_TOKEN  # 65,536 bytes
TEMPLATE = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}").compile()


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting the bytes it was asked to encode."""

    def __init__(self) -> None:
        self.encoded: list[int] = []

    def encode(
        self, text: str, add_special_tokens: bool = True, plain_spans: Sequence[Span] = ()
    ) -> list[int]:
        self.encoded.append(len(text.encode("utf-8")))
        return super().encode(text, add_special_tokens, plain_spans)


def make_context() -> tuple[ServerContext, CountingTokenizer]:
    tokenizer = CountingTokenizer()
    pool = SimpleNamespace(
        name="demo",
        served=ServedModel(("demo",), TEMPLATE, CONTEXT),
        rejected=Tally(),
        engine=SimpleNamespace(tokenizer=tokenizer),
    )
    service: Any = SimpleNamespace(
        pools={"demo": pool},
        pool=lambda name: pool,
        settings=RuntimeSettings(),
        accepting=True,
        alerts=[],
        kv_events=None,
    )
    return ServerContext(service, AgentConfig(), "http://node-1:8477", AuditLog(Tally())), tokenizer


def refused(awaitable: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        asyncio.run(awaitable)
    return caught.value


def test_tokenize_refuses_a_text_over_the_bound_without_tokenizing_it() -> None:
    ctx, tokenizer = make_context()
    error = refused(tokenize.tokenize(TokenizeRequest(prompt="é" * (LIMIT // 2 + 1)), ctx))
    assert error.status_code == 400 and error.param == "prompt"
    assert error.detail == (
        f"prompt: the prompt is {LIMIT + 2} bytes, over this agent's limit of {LIMIT} "
        f"(16 bytes per token of a {CONTEXT}-token prompt); shorten it"
    )
    assert tokenizer.encoded == []


def test_tokenize_refuses_a_batch_with_one_text_over_the_bound_before_any_is_tokenized() -> None:
    ctx, tokenizer = make_context()
    body = TokenizeRequest(prompt=["fine", "x" * (LIMIT + 1)])
    error = refused(tokenize.tokenize(body, ctx))
    assert error.status_code == 400 and error.param == "prompt.1"
    assert f"over this agent's limit of {LIMIT}" in error.detail
    assert tokenizer.encoded == []


def test_tokenize_counts_a_text_just_under_the_bound() -> None:
    ctx, tokenizer = make_context()
    body = TokenizeRequest(prompt=["x" * LIMIT, "ab"], return_token_ids=False)
    answer = asyncio.run(tokenize.tokenize(body, ctx))
    assert [r.count for r in answer.results] == [LIMIT + 1, 3]  # the bytes and BOS
    assert tokenizer.encoded == [LIMIT, 2]


def test_chat_refuses_messages_over_the_bound_without_tokenizing_them() -> None:
    ctx, tokenizer = make_context()
    halves = [{"role": "user", "content": "x" * (LIMIT // 2)}] * 2
    body = ChatCompletionRequest.model_validate(
        {"messages": [*halves, {"role": "user", "content": "y"}]}
    )
    gen = Generation.for_request(ctx, "chatcmpl", body, None)
    with pytest.raises(Refusal) as caught:
        asyncio.run(prompt_ids(gen, body))
    assert caught.value.status == 400
    assert f"the prompt is {LIMIT + 1} bytes, over this agent's limit of {LIMIT}" in str(
        caught.value
    )
    assert tokenizer.encoded == []


@pytest.mark.parametrize("route", ["tokenize", "cmpl", "chatcmpl"])
def test_every_route_tokenizes_under_the_one_lock(route: str) -> None:
    """While a text is being tokenized, no other route starts one."""
    ctx, tokenizer = make_context()

    async def tokenizing() -> object:
        if route == "tokenize":
            return await tokenize.tokenize(TokenizeRequest(prompt="ab"), ctx)
        return await Generation(ctx, route, ctx.service.pool("demo")).tokenize("ab")

    async def scenario() -> None:
        async with ctx.tokenizing:
            task = asyncio.ensure_future(tokenizing())
            await asyncio.sleep(0.2)
            assert tokenizer.encoded == [] and not task.done()
        await asyncio.wait_for(task, 5)
        assert tokenizer.encoded == [2]

    asyncio.run(scenario())
