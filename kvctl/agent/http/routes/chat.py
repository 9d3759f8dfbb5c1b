"""`POST /v1/chat/completions`: OpenAI chat, plain and streamed, through the model's template.

The conversation is rendered with the checkpoint's chat template and encoded as transformers
does it (`kvctl.agent.chat_prompt`), then generated like a completion: the model's EOS ids (from
generation_config.json) end a turn. A model without a template has no chat: 400 saying so.
Tool calling and structured output are not implemented and are refused by name, never ignored.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvctl.agent.chat_prompt import prompt_ids
from kvctl.agent.generation import ChoiceOutput, Generation, Opened, TokenLogprobs
from kvctl.agent.http.context import ApiError, Context
from kvctl.agent.http.routes.generation import GENERATION_ERRORS, answer
from kvctl.api import (
    MAX_LOGPROBS,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
)

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses=GENERATION_ERRORS,
)
async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: Context) -> Response:
    """OpenAI chat completions, streamed as `chat.completion.chunk` events with
    `stream: true`."""
    asked = body.max_completion_tokens or body.max_tokens
    gen = Generation.for_request(ctx, "chatcmpl", body, asked)
    _refuse_unsupported(body)
    gen.check_choices(1, body.n)
    ids = await prompt_ids(gen, body)
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = gen.sampling(body, gen.output_limit(asked, ids), top)
    opened = await gen.open([ids], params, body.n, body.cache_salt)
    shaper = _Shaper(gen, body, ids)
    return await answer(gen, opened, request, shaper, body.stream)


def _refuse_unsupported(body: ChatCompletionRequest) -> None:
    for name in ("tools", "functions", "function_call"):
        if getattr(body, name) is not None:
            raise ApiError(400, f"{name}: tool calling is not supported by this agent")
    if body.tool_choice not in (None, "none"):
        raise ApiError(400, "tool_choice: tool calling is not supported by this agent")
    for i, message in enumerate(body.messages):
        if message.role == "tool" or message.tool_calls is not None or message.tool_call_id:
            raise ApiError(
                400, f"messages.{i}: tool messages and tool calls are not supported by this agent"
            )
    if body.top_logprobs is not None:
        if body.top_logprobs > MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs: at most {MAX_LOGPROBS}, got {body.top_logprobs}")
        if body.top_logprobs and not body.logprobs:  # 0 is vLLM's default: nothing asked
            raise ApiError(400, "top_logprobs: needs logprobs set to true")


class _Shaper:
    """One chat request's choices in OpenAI's chat shapes."""

    def __init__(self, gen: Generation, body: ChatCompletionRequest, prompt: list[int]) -> None:
        self.gen, self.body, self.prompt = gen, body, prompt
        self.created = int(time.time())

    def logprobs(self, tokens: list[int], entries: list[TokenLogprobs | None]) -> ChatLogprobs:
        text = self.gen.token_text

        def top(token: int, logprob: float) -> ChatTopLogprob:
            piece = text(token)
            return ChatTopLogprob(token=piece, logprob=logprob, bytes=list(piece.encode()))

        content = []
        for token, entry in zip(tokens, entries, strict=True):
            if entry is None:
                continue
            chosen = top(token, entry.logprob)
            alternatives = [top(t, lp) for t, lp in entry.top]
            content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=alternatives))
        return ChatLogprobs(content=content)

    def response(self, opened: Opened, outputs: list[ChoiceOutput]) -> ChatCompletionResponse:
        body = self.body
        choices = [
            ChatChoice(
                index=out.index,
                message=ChatResponseMessage(content="".join(out.text)),
                finish_reason=out.finish_reason,
                logprobs=self.logprobs(out.token_ids, out.logprobs) if body.logprobs else None,
                token_ids=list(out.summary.output_ids) if body.return_token_ids else None,
                finish_detail=out.summary.finish_detail,
            )
            for out in outputs
        ]
        return ChatCompletionResponse(
            id=opened.request_id,
            created=self.created,
            model=self.gen.served.name,
            choices=choices,
            usage=self.gen.usage([o.summary for o in outputs], body.n),
            prompt_token_ids=self.prompt if body.return_token_ids else None,
        )

    async def sse(self, opened: Opened) -> AsyncIterator[str]:
        """A first chunk per choice with the assistant role, then one per token, the last of a
        choice with its finish reason; with `stream_options.include_usage`, a last chunk with
        no choices and the request's usage.

        The role chunk goes out with the choice's first token, as vLLM and OpenAI send it, not
        when the request is taken: a client times its first chunk as the first token, so an
        early empty chunk would show a time to first token that hides the prompt's computing
        and a time per token that includes it."""
        body = self.body
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        summaries: list[Any] = [None] * len(opened.streams)
        started: set[int] = set()
        async for index, event in self.gen.events(opened):
            if index not in started:
                started.add(index)
                role = {"role": "assistant", "content": ""}
                first = {"index": index, "delta": role, "logprobs": None, "finish_reason": None}
                yield self._line(opened, [first], include_usage)
            tokens = [] if event.token_id is None else [event.token_id]
            choice: dict[str, Any] = {
                "index": index,
                "delta": {"content": event.text} if event.text else {},
                "logprobs": None,
                "finish_reason": event.finish_reason.value if event.finish_reason else None,
            }
            if body.logprobs and tokens:
                choice["logprobs"] = self.logprobs(tokens, [event.logprobs]).model_dump()
            if body.return_token_ids:
                choice["token_ids"] = tokens
            if event.finish_reason is not None and event.summary is not None:
                summaries[index] = event.summary
                if event.summary.finish_detail:
                    choice["finish_detail"] = event.summary.finish_detail
            yield self._line(opened, [choice], include_usage)
        if include_usage:
            usage = self.gen.usage(summaries, body.n).model_dump(exclude_none=True)
            yield self._line(opened, [], include_usage, usage)
        yield "data: [DONE]\n\n"

    def _line(
        self,
        opened: Opened,
        choices: list[dict[str, Any]],
        include_usage: bool,
        usage: dict[str, Any] | None = None,
    ) -> str:
        chunk: dict[str, Any] = {
            "id": opened.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.gen.served.name,
            "choices": choices,
        }
        if include_usage:
            chunk["usage"] = usage  # null on every chunk but the last, as OpenAI sends it
        return f"data: {json.dumps(chunk)}\n\n"
