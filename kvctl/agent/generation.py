"""A generation request's work before and after the engine, for completions, chat and the prefix
routes alike: the checks before any work, tokenizing, queueing every choice, and reading their
tokens back as one stream.

Every limit is checked before the work it protects: the model's name, `max_tokens`, a text
prompt's size in bytes before it is tokenized (a prompt of many times the model's context can only
be refused, so it is never turned into a token list), tokenizing on a worker thread one text at a
time across all routes, /v1/tokenize included (the tokenizer lets go of the GIL while it works,
so neither the event loop nor the engine thread waits on it), and the queue's length on the
engine thread. A refusal (`Refusal`) says what was exceeded and what to do, with the HTTP status
the routes answer: 429 with `Retry-After` when the queue is full, 400 naming the pages needed and
the resize that would make room when a request could never fit, 503 while the agent drains.

A request with `n` choices (or several prompts) is one engine request per choice; choices of one
prompt share its pages (`kvctl.agent.runtime.choices`). Abandoning a request's events (a client
that went away) aborts every choice still running, so its pages are released instead of computed
for nobody.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import ValidationError

from kvctl.agent.config import AgentConfig
from kvctl.agent.model.processing import TokenLogprobs as TokenLogprobs
from kvctl.agent.model.sampling import SamplingParams as SamplingParams
from kvctl.agent.model.tokenizer import Span, Tokenizer
from kvctl.agent.model_pool import ModelPool
from kvctl.agent.runtime import Engine, FinishReason, RequestRefused, RequestTooLarge
from kvctl.agent.runtime import Request as EngineRequest
from kvctl.agent.runtime import RequestSummary as RequestSummary
from kvctl.agent.runtime import TokenEvent as TokenEvent
from kvctl.agent.served import ServedModel
from kvctl.agent.service import (
    AgentService,
    QueueFull,
    RequestStream,
    ShuttingDown,
    UnknownPool,
    WakeFailed,
)
from kvctl.api import FinishReasonName, GenerationFields, PromptTokensDetails, SamplingFields, Usage

MAX_BYTES_PER_TOKEN = 16
"""A text prompt longer than this many bytes per token of its limit is refused untokenized:
tokenizers average 1 (byte-level) to about 4-5 bytes per token on text and code, so such a
prompt is far over the limit anyway, and tokenizing it would only cost memory and time."""
RETRY_AFTER_S = 1
"""`Retry-After` of a 429: a slot in the queue opens as soon as one request is admitted."""
MAX_TOTAL_CHOICES = 64
"""Choices of one request in all (prompts × n): each is a sequence in the batch."""


class Refusal(Exception):
    """A request refused before or while it is queued, nothing computed: `status` is the HTTP
    status the routes answer with (400 invalid, 404 no such model, 429 the queue is full, 503
    draining or a model that cannot wake), `message` one line saying what to do, `param` the
    request field at fault, where there is one."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.error_type, self.headers = error_type, headers


class Serving(Protocol):
    """What a generation reads of the agent it runs in: the service, the configuration, the CLI
    command that reaches the agent (for the resize in a refusal) and the lock that tokenizes one
    text at a time (one per application)."""

    @property
    def service(self) -> AgentService: ...

    @property
    def config(self) -> AgentConfig: ...

    @property
    def kvctl(self) -> str: ...

    @property
    def tokenizing(self) -> asyncio.Semaphore: ...


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
    tokenizing: asyncio.Semaphore,
    tokenizer: Tokenizer,
    text: str,
    add_special_tokens: bool = True,
    plain_spans: Sequence[Span] = (),
) -> list[int]:
    """`text` as token ids, on a worker thread and one text at a time across all routes, so a
    burst of large texts holds one worker and one text's tokens at a time, not one per request."""
    async with tokenizing:
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


class Generation:
    """The steps of one generation request, bound to its model (its pool): `for_request` checks
    the request and binds them."""

    def __init__(
        self, agent: Serving, prefix: str, pool: ModelPool, tokens_as_ids: bool = False
    ) -> None:
        self.agent = agent
        self.service = agent.service
        self.config = agent.config
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

    def refuse(self, status: int, reason: str, message: str, param: str | None = None) -> Refusal:
        """A refusal counted in the pool's rejections under `reason`."""
        self.pool.rejected.add(reason)
        return Refusal(status, message, param=param)

    @classmethod
    def for_request(
        cls, agent: Serving, prefix: str, body: GenerationFields, max_tokens: int | None
    ) -> Generation:
        """The steps bound to the model `body` names (request ids start with `prefix`); 503
        while draining, 404 for a model not served here (400 for none when several are), 400
        over the token limit or for an output field the model cannot honour."""
        service = agent.service
        if not service.accepting:
            # counted on the first configured pool, whichever model the body names
            first = next(iter(service.pools.values()))
            raise cls(agent, prefix, first).refuse(
                503, "shutting_down", "the agent is shutting down"
            )
        try:
            pool = service.pool(body.model)
        except UnknownPool as unknown:
            message = str(unknown) if body.model else f"{unknown}; give `model`"
            kind = "model_not_found" if body.model else "model_required"
            raise Refusal(404 if body.model else 400, message, error_type=kind) from None
        bound = cls(agent, prefix, pool, bool(body.return_tokens_as_token_ids))
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
            raise Refusal(
                400,
                f"skip_special_tokens: model {self.served.name!r} has no text for its special "
                "tokens (a byte tokenizer, or none), so false would change nothing; leave it "
                "out or true",
            )
        kind = (body.response_format or {}).get("type", "text")
        if kind != "text":
            raise Refusal(
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
        return await encode(self.agent.tokenizing, tokenizer, text, add_special_tokens, plain_spans)

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
        self, body: SamplingFields, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        """The request's sampling fields as the engine runs them (400 for a combination the
        fields' own bounds let through: `min_tokens` above `max_tokens`)."""
        try:
            return SamplingParams.of(body, max_tokens, logprobs)
        except ValidationError as error:
            raise Refusal(400, first_error(error)) from None

    def output_limit(self, asked: int | None, prompt: Sequence[int]) -> int:
        """`max_tokens` of a request that may leave it out (chat): as asked, or as many as the
        agent's limit and the rest of the context allow; 400 when the prompt fills the context."""
        if asked is not None:
            return asked
        room = min(self.config.max_tokens_limit, self.served.context_length - len(prompt))
        if room < 1:
            raise self.refuse(
                400,
                "too_large",
                f"the conversation ({len(prompt)} tokens) fills the model's context",
            )
        return room

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
            raise Refusal(429, str(full), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except (ShuttingDown, WakeFailed) as unavailable:
            raise Refusal(503, str(unavailable)) from None
        except RequestTooLarge as large:
            raise Refusal(400, large.describe(self.agent.kvctl)) from None
        except RequestRefused as refused:
            raise Refusal(400, str(refused)) from None
        except ValueError as invalid:
            self.pool.rejected.add("invalid")
            raise Refusal(400, str(invalid)) from None

    async def warm(self, ids: list[int], salt: str | None) -> RequestStream:
        """Queue the prompt as a one-token greedy request in `salt`'s partition, so that its
        pages are cached when it ends (what warming a prefix is); 429 when the queue is full,
        409 for any other refusal."""
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def add(engine: Engine) -> EngineRequest:  # runs on the engine thread
            return engine.add_request(ids, params, cache_salt=salt)

        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wrap_future(self.service.open_stream(add, loop, self.pool))
        except RequestRefused as refused:
            status = 429 if refused.reason == "queue_full" else 409
            raise Refusal(status, str(refused)) from None

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


def first_error(error: ValidationError) -> str:
    """A validation error as one line: the first error's field and message (a ValueError raised
    by a validator as its own text)."""
    first = error.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ValueError):
        return str(cause)
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else first["msg"]
