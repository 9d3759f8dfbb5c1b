"""Reading one answer of a source (an agent, an engine's /metrics, Prometheus, Alertmanager)
within an overall deadline and a size cap, and JSON no deeper than kvctl's answers nest.

httpx's timeout bounds each read of the socket, not the answer: a source that drips a byte
every half second never trips it. Here the whole exchange has one deadline (the `--timeout`),
an answer stops being read past its cap, and JSON nested past `MAX_JSON_DEPTH` is refused
before a recursive parser sees it. Each limit is a `ReadLimit` whose text is one line, for the
caller to wrap in its own error (the node's row then says why it has no figures).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable

import httpx

MIB = 2**20
MAX_EXPOSITION_BYTES = 16 * MIB
"""A recorded /metrics of one model is 50 KB (vLLM) to 62 KB (SGLang), histograms included;
16 MiB is some 300 models on one endpoint."""
MAX_JSON_BYTES = 8 * MIB
"""An agent's pool list or a Prometheus answer for a fleet of thousands of nodes is well
below this."""
MAX_JSON_DEPTH = 64
"""kvctl's API and Prometheus' answers nest fewer than 10 levels; json and pydantic recurse
per level, so 100,000 levels end in a RecursionError, not a message."""

GRACE_S = 0.2
"""How long past the deadline the blocking read waits, so that an answer that never started
is reported as httpx words it (connection refused, no answer) rather than as a slow one."""

Sink = Callable[[bytes], None]
"""Takes each chunk of a successful answer as it arrives, instead of it being kept."""

_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_OPENERS = frozenset(b"[{")


class ReadLimit(Exception):
    """An answer broke a limit: too slow, too large or too deep; `str()` is one line."""


class TooSlow(ReadLimit):
    """The answer did not arrive complete within the deadline."""


def size_text(size: int) -> str:
    return f"{size / MIB:g} MiB" if size >= MIB else f"{size:,} bytes"


def check_depth(content: bytes | str, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON nested deeper than `limit`: its strings dropped, one pass over its brackets,
    with no recursion, so a hostile answer costs time linear in its size."""
    data = content.encode() if isinstance(content, str) else content
    if data.count(b"[") + data.count(b"{") <= limit:
        return
    depth = 0
    for byte in _STRINGS.sub(b"", data).translate(None, _NOT_BRACKETS):
        if byte in _OPENERS:
            depth += 1
            if depth > limit:
                raise ReadLimit(f"the answer nests deeper than {limit} levels")
        else:
            depth -= 1


def _slow(timeout: float) -> TooSlow:
    return TooSlow(f"no complete answer within {timeout:g} s")


class _Body:
    """Chunks of one answer: kept (or handed to a sink) up to the cap."""

    def __init__(self, cap: int, sink: Sink | None) -> None:
        self.cap, self.sink, self.size = cap, sink, 0
        self.chunks: list[bytes] = []

    def add(self, chunk: bytes, ok: bool) -> None:
        self.size += len(chunk)
        if self.size > self.cap:
            raise ReadLimit(f"the answer is larger than {size_text(self.cap)}")
        if ok and self.sink is not None:
            self.sink(chunk)
        else:
            self.chunks.append(chunk)

    def response(self, streamed: httpx.Response) -> httpx.Response:
        """The answer as a read response: status, type and the kept body (no encoding left)."""
        headers = {"content-type": streamed.headers.get("content-type", "")}
        return httpx.Response(
            streamed.status_code,
            headers=headers,
            content=b"".join(self.chunks),
            request=streamed.request,
        )


def read(
    client: httpx.Client,
    request: httpx.Request,
    timeout: float,
    cap: int,
    sink: Sink | None = None,
) -> httpx.Response:
    """Send `request` and read its answer within `timeout` seconds in all and `cap` bytes.

    The blocking client bounds each read of the socket only, headers included, so the exchange
    runs on a daemon thread that the caller waits for until the deadline; one still reading
    then is left to end with its socket (the command has its answer: no answer in time). A 2xx
    body goes to `sink` where given. Raises ReadLimit, or httpx.TransportError as httpx does."""
    outcome: list[httpx.Response | BaseException] = []

    def exchange() -> None:
        try:
            outcome.append(_exchange(client, request, timeout, cap, sink))
        except BaseException as error:  # handed to the waiting thread, raised there
            outcome.append(error)

    worker = threading.Thread(target=exchange, name="kvctl-read", daemon=True)
    worker.start()
    worker.join(timeout + GRACE_S)
    if not outcome:
        raise _slow(timeout)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _exchange(
    client: httpx.Client, request: httpx.Request, timeout: float, cap: int, sink: Sink | None
) -> httpx.Response:
    """The request and its answer, each read of the socket bounded by `timeout`."""
    request.extensions["timeout"] = httpx.Timeout(timeout).as_dict()
    streamed = client.send(request, stream=True)
    body = _Body(cap, sink)
    try:
        for chunk in streamed.iter_bytes():
            body.add(chunk, streamed.is_success)
    finally:
        streamed.close()
    return body.response(streamed)


async def aread(
    client: httpx.AsyncClient,
    request: httpx.Request,
    timeout: float,
    cap: int,
    sink: Sink | None = None,
) -> httpx.Response:
    """`read` for an async client: the deadline bounds the whole exchange, headers included."""
    body = _Body(cap, sink)
    try:
        async with asyncio.timeout(timeout):
            streamed = await client.send(request, stream=True)
            try:
                async for chunk in streamed.aiter_bytes():
                    body.add(chunk, streamed.is_success)
            finally:
                await streamed.aclose()
    except TimeoutError:
        raise _slow(timeout) from None
    return body.response(streamed)
