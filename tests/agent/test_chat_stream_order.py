"""A streamed chat answer's first chunk (the assistant role) goes out with the first token, not
when the request is taken: clients time their first chunk as the first token, so an early empty
chunk would report a time to first token that hides the prompt's computing."""

import asyncio
import json
from types import SimpleNamespace

from kvctl.agent.generation import Opened
from kvctl.agent.http.routes.chat import _Shaper
from kvctl.agent.runtime.engine import TokenEvent
from kvctl.agent.runtime.request import FinishReason
from kvctl.api import ChatCompletionRequest


class HeldGeneration:
    """Events of two choices, held back until `release` is set (the prompt being computed)."""

    served = SimpleNamespace(name="m")

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def events(self, opened: Opened):
        await self.release.wait()
        yield 0, TokenEvent("r", 5, "hi", None)
        yield 1, TokenEvent("r", 6, "yo", None)
        yield 0, TokenEvent("r", None, "", FinishReason.LENGTH)
        yield 1, TokenEvent("r", None, "", FinishReason.LENGTH)


def _choices(line: str) -> list[dict]:
    assert line.startswith("data: ")
    return json.loads(line.removeprefix("data: "))["choices"]


def test_no_chunk_is_sent_before_the_first_token_and_each_choice_opens_with_its_role() -> None:
    async def run() -> list[str]:
        gen = HeldGeneration()
        body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], n=2)
        shaper = _Shaper(gen, body, [1])  # type: ignore[arg-type]
        lines = shaper.sse(Opened("r", [object(), object()], 2)).__aiter__()  # type: ignore[list-item]
        pending = asyncio.ensure_future(lines.__anext__())
        await asyncio.sleep(0.05)
        assert not pending.done(), "a chunk went out before any token was computed"
        gen.release.set()
        return [await pending] + [line async for line in lines]

    lines = asyncio.run(run())
    deltas = [(c["index"], c["delta"]) for line in lines[:-1] for c in _choices(line)]
    assert deltas[:4] == [
        (0, {"role": "assistant", "content": ""}),
        (0, {"content": "hi"}),
        (1, {"role": "assistant", "content": ""}),
        (1, {"content": "yo"}),
    ]
    assert lines[-1] == "data: [DONE]\n\n"
