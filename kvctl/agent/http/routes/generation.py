"""What completions and chat share: the checks before any work, tokenizing, queueing every
choice of a request, and reading their tokens back as one stream.

Every limit is checked before the work it protects: the model's name, `max_tokens`, a text
prompt's size in bytes before it is tokenized (a prompt of many times the model's context can only
be refused, so it is never turned into a token list), tokenizing on a worker thread one text at a
time across all routes, /v1/tokenize included (the tokenizer lets go of the GIL while it works,
so neither the event loop nor the engine thread waits on it), and the queue's length on the
engine thread. A refusal says what was
exceeded and what to do: 429 with `Retry-After` when the queue is full, 400 naming the pages
needed and the resize that would make room when a request could never fit, 503 while the agent
drains.

A request with `n` choices (or several prompts) is one engine request per choice; choices of one
prompt share its pages (`kvctl.agent.runtime.choices`). A client that goes away is noticed and
every choice still running is aborted, so its pages are released instead of computed for nobody.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from kvctl.agent.config import AgentConfig
from kvctl.agent.http.context import ERRORS, ApiError, ServerContext
from kvctl.agent.model.processing import TokenLogprobs
from kvctl.agent.model.sampling import SamplingParams
from kvctl.agent.model.tokenizer import Span, Tokenizer
from kvctl.agent.model_pool import ModelPool
from kvctl.agent.runtime import (
    Engine,
    FinishReason,
    RequestRefused,
    RequestSummary,
    RequestTooLarge,
    TokenEvent,
)
from kvctl.agent.runtime import Request as EngineRequest
from kvctl.agent.served import ServedModel
from kvctl.agent.service import QueueFull, RequestStream, ShuttingDown, UnknownPool, WakeFailed
from kvctl.api import FinishReasonName, GenerationFields, PromptTokensDetails, Usage

GENERATION_ERRORS = {code: ERRORS[409] for code in (400, 404, 429, 503)} | ERRORS
"""The error answers of the generation routes, all in OpenAI's shape (for /openapi.json)."""

MAX_BYTES_PER_TOKEN = 16
"""A text prompt longer than this many bytes per token of its limit is refused untokenized:
tokenizers average 1 (byte-level) to about 4-5 bytes per token on text and code, so such a
prompt is far over the limit anyway, and tokenizing it would only cost memory and time."""
RETRY_AFTER_S = 1
"""`Retry-After` of a 429: a slot in the queue opens as soon as one request is admitted."""
MAX_TOTAL_CHOICES = 64
"""Choices of one request in all (prompts × n): each is a sequence in the batch."""


def prompt_limit(config: AgentConfig, served: ServedModel) -> int:
    """The most tokens a prompt of `served` may have on this agent."""
    return min(config.max_prompt_tokens, served.context_length)


def oversized(text: str, limit: int) -> str | None:
    """Why `text` is refused before it is tokenized, as a prompt of at most `limit` tokens; None
    when it may be tokenized. Tokenizing costs time in proportion to the text's length, so a
    text far over any limit is only measured."""
    size, byte_limit = len(text.encode("utf-8")), limit * MAX_BYTES_PER_TOKEN
    if size <= byte_limit:
        return None
    return (
        f"the prompt is {size} bytes, over this agent's limit of {byte_limit} "
        f"({MAX_BYTES_PER_TOKEN} bytes per token of a {limit}-token prompt); shorten it"
    )


async def encode(
    ctx: ServerContext,
    tokenizer: Tokenizer,
    text: str,
    add_special_tokens: bool = True,
    plain_spans: Sequence[Span] = (),
) -> list[int]:
    """`text` as token ids, on a worker thread and one text at a time across all routes, so a
    burst of large texts holds one worker and one text's tokens at a time, not one per request."""
    async with ctx.tokenizing:
        return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens, plain_spans)


@dataclass
class ChoiceOutput:
    """One choice's tokens as they arrive, and how it ended."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # the text each token added, for offsets
    last: TokenEvent | None = None

    def add(self, event: TokenEvent) -> None:
        self.text.append(event.text)
        if event.token_id is not None:
            self.token_ids.append(event.token_id)
            self.logprobs.append(event.logprobs)
            self.texts.append(event.text)
        elif self.texts:
            self.texts[-1] += event.text  # held-back text released at the end
        self.last = event

    @property
    def summary(self) -> RequestSummary:
        last = self.last
        if last is None or last.summary is None:
            raise RuntimeError("the summary of a choice that has not finished")
        return last.summary

    @property
    def finish_reason(self) -> FinishReasonName | None:
        reason = self.last.finish_reason if self.last is not None else None
        return FINISH_NAMES[reason] if reason is not None else None


FINISH_NAMES: dict[FinishReason, FinishReasonName] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.CAPACITY: "capacity",
}
"""The engine's reasons by their names in the answers (the same words, typed for the API)."""


@dataclass
class Opened:
    """A request's choices, queued: `streams[i]` is choice `i`; `n` choices per prompt."""

    request_id: str
    streams: list[RequestStream]
    n: int


class Shaper(Protocol):
    """One request's choices in an OpenAI answer shape (completions or chat)."""

    def response(self, opened: Opened, outputs: list[ChoiceOutput]) -> BaseModel: ...

    def sse(self, opened: Opened) -> AsyncIterator[str]: ...


class Generation:
    """The shared steps of an OpenAI generation route, bound to one request's model (its pool):
    `for_request` checks the request and binds them."""

    def __init__(
        self, ctx: ServerContext, prefix: str, pool: ModelPool, tokens_as_ids: bool = False
    ) -> None:
        self.ctx = ctx
        self.service = ctx.service
        self.config = ctx.config
        self.prefix = prefix
        self.pool = pool
        self.tokens_as_ids = tokens_as_ids  # the request's return_tokens_as_token_ids

    @property
    def served(self) -> ServedModel:
        return self.pool.served

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.pool.engine.tokenizer

    @property
    def prompt_limit(self) -> int:
        return prompt_limit(self.config, self.served)

    def refuse(self, status: int, reason: str, message: str, param: str | None = None) -> ApiError:
        self.pool.rejected.add(reason)
        return ApiError(status, message, param=param)

    @classmethod
    def for_request(
        cls, ctx: ServerContext, prefix: str, body: GenerationFields, max_tokens: int | None
    ) -> Generation:
        """The steps bound to the model `body` names (request ids start with `prefix`); 503
        while draining, 404 for a model not served here (400 for none when several are), 400
        over the token limit or for an output field the model cannot honour."""
        service = ctx.service
        if not service.accepting:
            # counted on the first configured pool, whichever model the body names
            first = next(iter(service.pools.values()))
            raise cls(ctx, prefix, first).refuse(503, "shutting_down", "the agent is shutting down")
        try:
            pool = service.pool(body.model)
        except UnknownPool as unknown:
            message = str(unknown) if body.model else f"{unknown}; give `model`"
            kind = "model_not_found" if body.model else "model_required"
            raise ApiError(404 if body.model else 400, message, error_type=kind) from None
        bound = cls(ctx, prefix, pool, bool(body.return_tokens_as_token_ids))
        bound.check_limits(max_tokens)
        bound.check_output(body)
        return bound

    def check_limits(self, max_tokens: int | None) -> None:
        if max_tokens is not None and max_tokens > self.config.max_tokens_limit:
            raise self.refuse(
                400,
                "invalid",
                f"max_tokens {max_tokens} is above this agent's limit of "
                f"{self.config.max_tokens_limit}",
            )

    def check_output(self, body: GenerationFields) -> None:
        """400 for output settings this model cannot give: special tokens' text from a tokenizer
        whose special tokens have none, a response format other than text."""
        tokenizer = self.tokenizer
        if not body.skip_special_tokens and (
            tokenizer is None or not tokenizer.has_special_token_text
        ):
            raise ApiError(
                400,
                f"skip_special_tokens: model {self.served.name!r} has no text for its special "
                "tokens (a byte tokenizer, or none), so false would change nothing; leave it "
                "out or true",
            )
        kind = (body.response_format or {}).get("type", "text")
        if kind != "text":
            raise ApiError(
                400, f"response_format: only type 'text' is supported by this agent, got {kind!r}"
            )

    def check_choices(self, prompts: int, n: int) -> None:
        if prompts * n > MAX_TOTAL_CHOICES:
            raise self.refuse(
                400,
                "invalid",
                f"n: {prompts} prompts × n {n} is {prompts * n} choices, over this agent's limit "
                f"of {MAX_TOTAL_CHOICES}; send fewer prompts or a smaller n",
            )

    async def tokenize(
        self, text: str, add_special_tokens: bool = True, plain_spans: Sequence[Span] = ()
    ) -> list[int]:
        """`text` as token ids, refused before tokenizing when it is too long; special-token
        text inside `plain_spans` is tokenized as plain text."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise self.refuse(400, "invalid", "this model has no tokenizer: send token ids")
        refusal = oversized(text, self.prompt_limit)
        if refusal is not None:
            raise self.refuse(400, "invalid", refusal)
        return await encode(self.ctx, tokenizer, text, add_special_tokens, plain_spans)

    def check_vocabulary(self, ids: Sequence[int], field: str) -> None:
        """400 naming the first id of a token-id prompt that the model has no token for, before
        anything reads it (echo decodes the prompt, the engine embeds it)."""
        vocab = self.pool.engine.model_config.vocab_size
        if ids and max(ids) >= vocab:
            bad = next(i for i, token in enumerate(ids) if token >= vocab)
            raise self.refuse(
                400,
                "invalid",
                f"{field}: token id {ids[bad]} at index {bad} is outside the model's vocabulary "
                f"of {vocab} tokens (ids 0 to {vocab - 1})",
                param=field,
            )

    def check_length(self, ids: Sequence[int]) -> None:
        limit = self.prompt_limit
        if len(ids) > limit:
            raise self.refuse(
                400,
                "invalid",
                f"the prompt has {len(ids)} tokens, over this agent's limit of {limit}",
            )

    def sampling(
        self, body: GenerationFields, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        bias = tuple(sorted((int(k), float(v)) for k, v in (body.logit_bias or {}).items()))
        try:
            return SamplingParams(
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                max_tokens=max_tokens,
                stop=stop,
                ignore_eos=body.ignore_eos,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                logit_bias=bias,
                logprobs=logprobs,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                min_tokens=body.min_tokens,
                min_p=body.min_p,
                repetition_penalty=body.repetition_penalty,
                allowed_token_ids=tuple(body.allowed_token_ids or ()),
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                spaces_between_special_tokens=body.spaces_between_special_tokens,
            )
        except ValueError as error:
            raise ApiError(400, str(error)) from None

    async def open(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        n: int,
        cache_salt: str | None,
    ) -> Opened:
        """Queue `n` choices of every prompt; all or none (a refusal aborts those queued)."""
        request_id = f"{self.prefix}-{uuid.uuid4().hex[:24]}"
        streams: list[RequestStream] = []
        try:
            for p, ids in enumerate(prompts):
                first = None
                for choice in range(n):
                    index = p * n + choice
                    rid = request_id if index == 0 else f"{request_id}-{index}"
                    streams.append(
                        await self._open_one(ids, params, rid, cache_salt, first, choice)
                    )
                    first = first or rid
        except BaseException:
            for stream in streams:
                self.service.abort(stream.request_id)
            raise
        return Opened(request_id, streams, n)

    async def _open_one(
        self,
        ids: list[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None,
        first: str | None,
        choice: int,
    ) -> RequestStream:
        def add(engine: Engine) -> EngineRequest:  # runs on the engine thread
            return engine.add_request(
                ids,
                params,
                request_id=request_id,
                cache_salt=cache_salt,
                first_choice=first,
                choice=choice,
            )

        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wrap_future(self.service.open_stream(add, loop, self.pool))
        except QueueFull as full:
            raise ApiError(429, str(full), {"Retry-After": str(RETRY_AFTER_S)}) from None
        except (ShuttingDown, WakeFailed) as unavailable:
            raise ApiError(503, str(unavailable)) from None
        except RequestTooLarge as large:
            raise ApiError(400, large.describe(self.ctx.kvctl)) from None
        except RequestRefused as refused:
            raise ApiError(400, str(refused)) from None
        except ValueError as invalid:
            self.pool.rejected.add("invalid")
            raise ApiError(400, str(invalid)) from None

    async def events(self, opened: Opened) -> AsyncIterator[tuple[int, TokenEvent]]:
        """Every choice's events as (choice index, event) in arrival order, until all have
        finished; abandoning the iteration aborts the choices still running."""
        merged: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            while True:
                event = await stream.events.get()
                merged.put_nowait((index, event))
                if event.finish_reason is not None:
                    return

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(opened.streams)]
        running = set(range(len(opened.streams)))
        try:
            while running:
                index, event = await merged.get()
                if event.finish_reason is not None:
                    running.discard(index)
                yield index, event
        finally:
            for task in tasks:
                task.cancel()
            for index in running:
                self.service.abort(opened.streams[index].request_id)

    async def answer(
        self, opened: Opened, request: Request, shaper: Shaper, stream: bool
    ) -> Response:
        """The events as they come (server-sent), or the whole answer once every choice ended."""
        if stream:
            return StreamingResponse(shaper.sse(opened), media_type="text/event-stream")
        outputs = await self.collect(opened, request)
        if isinstance(outputs, Response):
            return outputs
        return JSONResponse(shaper.response(opened, outputs).model_dump())

    async def collect(self, opened: Opened, request: Request) -> list[ChoiceOutput] | Response:
        """Every choice to its end; a 499 response when the client leaves first (its choices
        are aborted, their pages freed)."""

        async def gather() -> list[ChoiceOutput]:
            outputs = [ChoiceOutput(i) for i in range(len(opened.streams))]
            async for index, event in self.events(opened):
                outputs[index].add(event)
            return outputs

        collecting = asyncio.ensure_future(gather())
        gone = asyncio.ensure_future(disconnected(request))
        await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not collecting.done():
            collecting.cancel()
            await asyncio.gather(collecting, return_exceptions=True)
            return Response(status_code=499)
        gone.cancel()
        return collecting.result()

    def usage(self, summaries: Sequence[RequestSummary | None], n: int) -> Usage:
        """OpenAI's usage of a whole request: each prompt counted once (its first choice),
        every choice's output. `cached_tokens` only when the operator opted in, because it
        tells a client whether others sent the same prompt prefix (docs/security.md)."""
        firsts = [s for i, s in enumerate(summaries) if i % n == 0 and s is not None]
        prompt = sum(s.prompt_tokens for s in firsts)
        completion = sum(len(s.output_ids) for s in summaries if s is not None)
        cached = PromptTokensDetails(cached_tokens=sum(s.cached_tokens for s in firsts))
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=cached if self.config.report_cached_tokens else None,
        )

    def token_text(self, token_id: int) -> str:
        """A token as text, for log-probabilities (`token_id:N` without a tokenizer, or when the
        request asked for `return_tokens_as_token_ids`)."""
        tokenizer = self.tokenizer
        if tokenizer is None or self.tokens_as_ids:
            return f"token_id:{token_id}"
        return tokenizer.decode([token_id])


async def disconnected(request: Request) -> None:
    """Return when the client closes its connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
