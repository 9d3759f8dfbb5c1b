"""Send a profile's requests to an agent, open loop (a rate) or closed loop (a concurrency).

Closed loop keeps `concurrency` requests in flight (default 4), each sent when one finishes:
the pressure of a fixed number of users. Open loop sends at the profile's arrival times
whatever the agent does (capped at `concurrency` in flight, default 64): the pressure of real
traffic, which is what fills a pool. Arrivals are scheduled against the start time, not the
previous send, so the rate does not drift. Every run is bounded: no request starts after
`duration` or past `requests`, and requests still running `drain` seconds after that are
cancelled and counted as such. Each request streams, so the time to the first token is
measured as the user would see it. Requests go to `/v1/chat/completions` as conversations when
the plan says the model has chat (`setup.prepare`), else to `/v1/completions` as text.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvctl.api import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    StreamOptions,
    Usage,
)
from kvctl.client import AgentError, AsyncAgentClient
from kvctl.load.profiles import PROFILES, LoadRequest
from kvctl.load.report import LoadReport, RequestResult
from kvctl.load.setup import LoadPlan

CLOSED_LOOP_USERS = 4
OPEN_LOOP_CAP = 64


@dataclass(frozen=True)
class LoadSettings:
    """How to drive one run; `rate` None means closed loop unless the profile has a default."""

    profile: str = "chat"
    seed: int = 0
    max_tokens: int = 32
    rate: float | None = None
    concurrency: int | None = None
    duration: float = 30.0
    requests: int | None = None
    drain: float = 10.0
    temperature: float = 1.0
    model: str | None = None  # the model requests name (None: the agent's only one)

    @property
    def effective_rate(self) -> float | None:
        return self.rate if self.rate is not None else PROFILES[self.profile].default_rate

    @property
    def in_flight(self) -> int:
        """The concurrency given, else 4 users in closed loop or a cap of 64 in open loop."""
        if self.concurrency is not None:
            return self.concurrency
        return OPEN_LOOP_CAP if self.effective_rate else CLOSED_LOOP_USERS


OnResult = Callable[[RequestResult], None]


async def send(
    client: AsyncAgentClient,
    request: LoadRequest,
    settings: LoadSettings,
    clock: Callable[[], float] = time.monotonic,
    chat: bool = False,
) -> RequestResult:
    """Stream one request; its latency, time to first token and token counts."""
    if chat:
        return await send_chat(client, request, settings, clock)
    body = CompletionRequest(
        prompt=request.prompt,
        **_generation(request, settings),
    )

    async def chunks() -> AsyncIterator[tuple[int, Usage | None]]:
        async for chunk in client.stream_completion(body):
            yield sum(_completion_tokens(choice) for choice in chunk.choices), chunk.usage

    return await _measure(request, chunks(), clock)


async def send_chat(
    client: AsyncAgentClient,
    request: LoadRequest,
    settings: LoadSettings,
    clock: Callable[[], float] = time.monotonic,
) -> RequestResult:
    """Stream one chat completion of the request's conversation."""
    body = ChatCompletionRequest(
        messages=[ChatMessage.model_validate({"role": r, "content": c}) for r, c in request.chat],
        **_generation(request, settings),
    )

    async def chunks() -> AsyncIterator[tuple[int, Usage | None]]:
        async for chunk in client.stream_chat(body):
            tokens = sum(_chat_tokens(choice) for choice in chunk.get("choices") or ())
            usage = chunk.get("usage")
            yield tokens, Usage.model_validate(usage) if usage else None

    return await _measure(request, chunks(), clock)


def _generation(request: LoadRequest, settings: LoadSettings) -> dict[str, Any]:
    """What every load request asks, chat or not: its length, temperature and own seed, no
    early EOS, and token ids and usage in the stream, so tokens are counted, not guessed."""
    return dict(
        model=settings.model,
        max_tokens=request.max_tokens,
        temperature=settings.temperature,
        seed=settings.seed * 1_000_003 + request.index,
        ignore_eos=True,
        return_token_ids=True,
        stream_options=StreamOptions(include_usage=True),
    )


async def _measure(
    request: LoadRequest,
    chunks: AsyncIterator[tuple[int, Usage | None]],
    clock: Callable[[], float],
) -> RequestResult:
    """Latency, time to first token and tokens of one stream of (tokens, usage) chunks; the
    clock starts before the request is sent (the first chunk sends it)."""
    start = clock()
    ttft: float | None = None
    counted = 0
    usage = None
    try:
        async for tokens, chunk_usage in chunks:
            if tokens and ttft is None:
                ttft = clock() - start
            counted += tokens
            usage = chunk_usage or usage
    except AgentError as error:
        return RequestResult(request.index, clock() - start, ttft, error=str(error))
    return _result(request, clock() - start, ttft, counted, usage)


def _completion_tokens(choice: CompletionChoice) -> int:
    """Tokens in one streamed completion choice: its token ids, else one per piece of text."""
    return len(choice.token_ids) if choice.token_ids else int(bool(choice.text))


def _chat_tokens(choice: dict[str, Any]) -> int:
    """Tokens in one streamed chat choice: its token ids, else one per piece of content."""
    ids = choice.get("token_ids")
    if ids:
        return len(ids)
    return int(bool((choice.get("delta") or {}).get("content")))


def _result(
    request: LoadRequest, latency: float, ttft: float | None, counted: int, usage: Usage | None
) -> RequestResult:
    if usage is None:
        return RequestResult(request.index, latency, ttft, completion_tokens=counted)
    return RequestResult(
        request.index,
        latency,
        ttft,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=details.cached_tokens if (details := usage.prompt_tokens_details) else None,
        completion_tokens=usage.completion_tokens,
    )


class LoadRun:
    """One bounded run: the request stream, the in-flight tasks and the results so far."""

    def __init__(
        self,
        client: AsyncAgentClient,
        settings: LoadSettings,
        on_result: OnResult | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        plan: LoadPlan | None = None,
    ) -> None:
        self.client = client
        self.settings = settings
        self.plan = plan or LoadPlan()
        self.on_result = on_result
        self.clock = clock
        self.sleep = sleep
        profile = PROFILES[settings.profile]
        stream = profile.requests(
            random.Random(settings.seed), settings.max_tokens, self.plan.lexicon
        )
        self.pending: Iterator[LoadRequest] = itertools.islice(stream, settings.requests)
        self.results: list[RequestResult] = []
        self.started = 0.0
        self.deadline = 0.0
        self.stopped_by: str | None = None
        self._senders: asyncio.Task[None] | None = None

    async def run(self) -> LoadReport:
        """Drive the agent until the request count or the duration is reached, then report."""
        self.started = self.clock()
        self.deadline = self.started + self.settings.duration
        rate = self.settings.effective_rate
        senders = self._open_loop(rate) if rate else self._closed_loop()
        self._senders = asyncio.ensure_future(senders)
        try:
            await asyncio.wait_for(self._senders, self.settings.duration + self.settings.drain)
        except TimeoutError:
            pass
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.stopped_by is None or (task is not None and task.cancelling()):
                raise  # not our stop: whoever cancelled the run wants it gone
        return self._report(rate)

    def stop(self, why: str) -> None:
        """End the run now (a signal): no new requests, in-flight ones cancelled and counted as
        such, and `run` returns the report of what happened so far."""
        if self.stopped_by is not None:
            return
        self.stopped_by = why
        self.deadline = self.clock()
        if self._senders is not None:
            self._senders.cancel()

    def _next(self) -> LoadRequest | None:
        if self.clock() >= self.deadline:
            return None
        return next(self.pending, None)

    async def _one(self, request: LoadRequest) -> None:
        try:
            result = await send(self.client, request, self.settings, self.clock, self.plan.chat)
        except asyncio.CancelledError:
            result = RequestResult(request.index, latency=0.0, cancelled=True)
            self._record(result)
            raise
        self._record(result)

    def _record(self, result: RequestResult) -> None:
        self.results.append(result)
        if self.on_result is not None:
            self.on_result(result)

    async def _closed_loop(self) -> None:
        async def worker() -> None:
            while (request := self._next()) is not None:
                await self._one(request)

        await asyncio.gather(*(worker() for _ in range(self.settings.in_flight)))

    async def _open_loop(self, rate: float) -> None:
        profile = PROFILES[self.settings.profile]
        gaps = profile.gaps(random.Random(self.settings.seed + 1), rate)
        slots = asyncio.Semaphore(self.settings.in_flight)
        tasks: set[asyncio.Task[None]] = set()
        due = self.started
        try:
            while True:
                due += next(gaps)
                await self.sleep(max(0.0, due - self.clock()))
                await slots.acquire()
                request = self._next()
                if request is None:
                    slots.release()
                    break
                task = asyncio.create_task(self._one(request))
                tasks.add(task)

                def release(done: asyncio.Task[None]) -> None:
                    tasks.discard(done)
                    slots.release()

                task.add_done_callback(release)
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _report(self, rate: float | None) -> LoadReport:
        return LoadReport(
            profile=self.settings.profile,
            seed=self.settings.seed,
            mode="open" if rate else "closed",
            rate=rate,
            concurrency=self.settings.in_flight,
            duration_s=self.clock() - self.started,
            results=tuple(self.results),
            stopped_by=self.stopped_by,
            endpoint=self.plan.endpoint,
        )


async def run_load(
    client: AsyncAgentClient, settings: LoadSettings, on_result: OnResult | None = None
) -> LoadReport:
    """Run `settings` against `client` (chat or not, lengths in its tokens) and report."""
    from kvctl.load.setup import prepare

    plan = await prepare(client)
    return await LoadRun(client, settings, on_result, plan=plan).run()
