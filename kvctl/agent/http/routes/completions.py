"""`POST /v1/completions`: OpenAI-compatible completions, plain and streamed.

A prompt is text or token ids, or a list of either; each prompt gets `n` choices, numbered
prompt by prompt (choice `p * n + i`). The checks, queueing and streaming shared with chat live
in `kvctl.agent.generation`; this module turns prompts into ids and choices into OpenAI's
completion shapes (legacy `logprobs` with tokens, token_logprobs, top_logprobs and text_offset;
`echo`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvctl.agent.generation import ChoiceOutput, Generation, Opened, TokenLogprobs
from kvctl.agent.http.context import ApiError, Context
from kvctl.agent.http.routes.generation import GENERATION_ERRORS, answer
from kvctl.api import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)

MAX_COMPLETION_LOGPROBS = 5
"""OpenAI's limit of `logprobs` on completions."""


router = APIRouter()


async def prompt_list(gen: Generation, body: CompletionRequest) -> list[list[int]]:
    """Every prompt of `body` as token ids, each checked against the model and the limits."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and isinstance(prompt[0], str | list):
        prompts = list(prompt)
    else:
        prompts = [prompt]  # type: ignore[list-item]  # a list of ints: isinstance cannot narrow it
    gen.check_choices(len(prompts), body.n)
    result = []
    for p, one in enumerate(prompts):
        if isinstance(one, str):
            ids = await gen.tokenize(one, add_special_tokens=body.add_special_tokens)
        else:
            ids = list(one)
            gen.check_vocabulary(ids, "prompt" if len(prompts) == 1 else f"prompt.{p}")
        gen.check_length(ids)
        result.append(ids)
    return result


def echoes(gen: Generation, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """The text `echo` puts before each prompt's choices: the prompt as sent, or decoded."""
    if not body.echo:
        return [""] * len(prompts)
    if isinstance(body.prompt, str):
        return [body.prompt]
    if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
        return list(body.prompt)
    tokenizer = gen.tokenizer
    if tokenizer is None:
        raise ApiError(400, "echo: this model has no tokenizer to turn token ids into text")
    return [tokenizer.decode(ids) for ids in prompts]


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses=GENERATION_ERRORS,
)
async def completions(body: CompletionRequest, request: Request, ctx: Context) -> Response:
    """OpenAI completions, streamed as server-sent events with `stream: true`."""
    gen = Generation.for_request(ctx, "cmpl", body, body.max_tokens)
    _refuse_unsupported(body)
    prompts = await prompt_list(gen, body)
    echo = echoes(gen, body, prompts)
    params = gen.sampling(body, body.max_tokens, body.logprobs)
    opened = await gen.open(prompts, params, body.n, body.cache_salt)
    shaper = _Shaper(gen, body, prompts, echo)
    return await answer(gen, opened, request, shaper, body.stream)


def _refuse_unsupported(body: CompletionRequest) -> None:
    if body.logprobs is not None and body.logprobs > MAX_COMPLETION_LOGPROBS:
        raise ApiError(
            400, f"logprobs: at most {MAX_COMPLETION_LOGPROBS} on completions, got {body.logprobs}"
        )
    if body.best_of is not None and body.best_of not in (1, body.n):
        raise ApiError(
            400,
            f"best_of: {body.best_of} is not supported (choices are returned as sampled; "
            "leave best_of out or set it to n)",
        )
    if body.suffix is not None:
        raise ApiError(400, "suffix: insertion (text after the completion) is not supported")
    if body.echo and body.logprobs is not None:
        raise ApiError(
            400,
            "echo with logprobs: this agent does not compute the prompt's log-probabilities; "
            "leave out one of them",
        )


class _Shaper:
    """One request's choices in OpenAI's completion shapes."""

    def __init__(
        self, gen: Generation, body: CompletionRequest, prompts: list[list[int]], echo: list[str]
    ) -> None:
        self.gen, self.body, self.prompts, self.echo = gen, body, prompts, echo
        self.created = int(time.time())

    def _echo(self, index: int) -> str:
        return self.echo[index // self.body.n]

    def logprobs(
        self, start: int, tokens: list[int], entries: list[TokenLogprobs | None], texts: list[str]
    ) -> CompletionLogprobs | None:
        """The legacy shape; `start` is where the first token's text starts in the choice's
        text (after the echoed prompt), `texts` the text each token added."""
        if self.body.logprobs is None:
            return None
        text = self.gen.token_text
        offsets, at = [], start
        for piece in texts:
            offsets.append(at)
            at += len(piece)
        tops: list[dict[str, float] | None] = []
        for token, entry in zip(tokens, entries, strict=True):
            top = {text(t): lp for t, lp in entry.top} if entry else {}
            if entry is not None:
                top.setdefault(text(token), entry.logprob)
            tops.append(top)
        return CompletionLogprobs(
            tokens=[text(t) for t in tokens],
            token_logprobs=[e.logprob if e else None for e in entries],
            top_logprobs=tops,
            text_offset=offsets,
        )

    def response(self, opened: Opened, outputs: list[ChoiceOutput]) -> CompletionResponse:
        body = self.body
        choices = []
        for out in outputs:
            summary = out.summary
            choices.append(
                CompletionChoice(
                    index=out.index,
                    text=self._echo(out.index) + "".join(out.text),
                    finish_reason=out.finish_reason,
                    logprobs=self.logprobs(
                        len(self._echo(out.index)), out.token_ids, out.logprobs, out.texts
                    ),
                    token_ids=list(summary.output_ids) if body.return_token_ids else None,
                    prompt_token_ids=(
                        self.prompts[out.index // body.n] if body.return_token_ids else None
                    ),
                    finish_detail=summary.finish_detail,
                )
            )
        return CompletionResponse(
            id=opened.request_id,
            created=self.created,
            model=self.gen.served.name,
            choices=choices,
            usage=self.gen.usage([o.summary for o in outputs], body.n),
        )

    async def sse(self, opened: Opened) -> AsyncIterator[str]:
        """Server-sent events: one chunk per token and choice, the last of a choice with its
        finish reason (and its usage, unless `stream_options.include_usage` asks for one
        usage chunk for the whole request at the end)."""
        body = self.body
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        offsets: dict[int, int] = {}  # where each choice's next text starts
        summaries: list[Any] = [None] * len(opened.streams)
        async for index, event in self.gen.events(opened):
            text = event.text
            if index not in offsets:
                offsets[index] = len(self._echo(index))
                text = self._echo(index) + text
            tokens = [] if event.token_id is None else [event.token_id]
            choice: dict[str, Any] = {
                "index": index,
                "text": text,
                "finish_reason": event.finish_reason.value if event.finish_reason else None,
                "logprobs": None,
            }
            if body.logprobs is not None and tokens:
                logprobs = self.logprobs(offsets[index], tokens, [event.logprobs], [event.text])
                choice["logprobs"] = logprobs.model_dump() if logprobs else None
            offsets[index] += len(event.text)
            if body.return_token_ids:
                choice["token_ids"] = tokens
            chunk = self._chunk(opened, [choice])
            if event.finish_reason is not None and event.summary is not None:
                summaries[index] = event.summary
                if event.summary.finish_detail:
                    choice["finish_detail"] = event.summary.finish_detail
                if not include_usage:
                    usage = self.gen.usage([event.summary], 1)
                    chunk["usage"] = usage.model_dump(exclude_none=True)
            yield f"data: {json.dumps(chunk)}\n\n"
        if include_usage:
            chunk = self._chunk(opened, [])
            chunk["usage"] = self.gen.usage(summaries, body.n).model_dump(exclude_none=True)
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    def _chunk(self, opened: Opened, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": opened.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.gen.served.name,
            "choices": choices,
        }
