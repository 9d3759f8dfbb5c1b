"""What completions and chat share on the HTTP side: binding a request to its generation, their
error answers, and sending the choices back, streamed as server-sent events or whole.

The work itself (checks, tokenizing, queueing, the tokens' stream) is `kvctl.agent.generation`'s;
a client that goes away while a whole answer is gathered is noticed here, and every choice still
running is aborted, so its pages are released instead of computed for nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from kvctl.agent.generation import ChoiceOutput, Generation, Opened
from kvctl.agent.http.context import ERRORS

GENERATION_ERRORS = {code: ERRORS[409] for code in (400, 404, 429, 503)} | ERRORS
"""The error answers of the generation routes, all in OpenAI's shape (for /openapi.json)."""


class Shaper(Protocol):
    """One request's choices in an OpenAI answer shape (completions or chat)."""

    def response(self, opened: Opened, outputs: list[ChoiceOutput]) -> BaseModel: ...

    def sse(self, opened: Opened) -> AsyncIterator[str]: ...


async def answer(
    gen: Generation, opened: Opened, request: Request, shaper: Shaper, stream: bool
) -> Response:
    """The events as they come (server-sent), or the whole answer once every choice ended."""
    if stream:
        return StreamingResponse(shaper.sse(opened), media_type="text/event-stream")
    outputs = await collect(gen, opened, request)
    if isinstance(outputs, Response):
        return outputs
    return JSONResponse(shaper.response(opened, outputs).model_dump())


async def collect(
    gen: Generation, opened: Opened, request: Request
) -> list[ChoiceOutput] | Response:
    """Every choice to its end; a 499 response when the client leaves first (its choices are
    aborted, their pages freed)."""

    async def gather() -> list[ChoiceOutput]:
        outputs = [ChoiceOutput(i) for i in range(len(opened.streams))]
        async for index, event in gen.events(opened):
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


async def disconnected(request: Request) -> None:
    """Return when the client closes its connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
