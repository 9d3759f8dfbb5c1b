"""Typed HTTP client of the kvctl agent API: the only way the CLI and the TUI reach an agent.

Every answer is parsed into the models of `kvctl.api`, and every failure (no connection, a
timeout, a 401, a refused resize, an agent that is not a kvctl agent) becomes an `AgentError`
whose message is one line that names the agent and says what to do, so callers print it as is.
Every answer is read within the timeout in all and a size cap (`kvctl.bounded_read`), so a node
that drips or floods costs one timeout, like one that hangs.
`AgentClient` is synchronous for the CLI; `AsyncAgentClient` has the same methods as coroutines
for the TUI and the load generator, which must not block while waiting on an agent. Both take an
optional httpx transport, so tests can answer without a socket.

An agent has one pool per served model. The pool methods take `pool` (a model's name) and then
use `/v1/pools/NAME/...`; without it they use the single-pool routes, which an agent serving
several models answers with `AgentNeedsPool`, its message naming them.
"""

from __future__ import annotations

import functools
import json
import ssl
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Generic, Self, TypeVar
from urllib.parse import quote, urlsplit

import httpx
from pydantic import BaseModel, ValidationError

from kvctl import __version__, bounded_read
from kvctl.api import (
    DEFAULT_PORT,
    POOL_REQUIRED,
    UNKNOWN_POOL,
    UNKNOWN_PREFIX_ITEM,
    AlertList,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    DefragRequest,
    DefragResult,
    ErrorBody,
    Health,
    ModelList,
    PoolList,
    PoolMap,
    PoolRelease,
    PoolSnapshot,
    PrefixClearRequest,
    PrefixClearResult,
    PrefixListing,
    PrefixLookupResult,
    PrefixMoveRequest,
    PrefixPinRequest,
    PrefixPinView,
    PrefixQuery,
    ResizeRequest,
    ResizeResult,
    RuntimeSettings,
    RuntimeSettingsPatch,
    SleepRequest,
    SleepResult,
    TokenizeRequest,
    TokenizeResponse,
    WakeResult,
)
from kvctl.bounded_read import MAX_EXPOSITION_BYTES, MAX_JSON_BYTES, ReadLimit, Sink, check_depth
from kvctl.exposition import Exposition, ExpositionReader

DEFAULT_AGENT = f"http://127.0.0.1:{DEFAULT_PORT}"
DEFAULT_TIMEOUT = 10.0
"""Seconds to wait for one answer, complete (`kvctl.bounded_read`); a pool read takes
milliseconds, so this only bounds a hang."""

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


# ---- errors ---------------------------------------------------------------------------------


class AgentError(Exception):
    """An agent could not do what was asked; `str()` is one line naming the agent and a fix.

    `reason` is the short cause alone ("connection refused", "401 unauthorized"), for a table
    cell where the agent is already named.
    """

    def __init__(self, agent: str, message: str, reason: str | None = None) -> None:
        super().__init__(" ".join(message.split()))
        self.agent = agent
        self.reason = " ".join((reason or message).split())


class AgentUnreachable(AgentError):
    """No answer: connection refused, unknown host, timeout, connection dropped."""


class NotAnAgent(AgentUnreachable):
    """Something answered at the URL, but not a kvctl agent: a wrong URL, like no answer."""


class AgentUnauthorized(AgentError):
    """401/403: the agent has a token and this request did not carry the right one."""


class AgentRefused(AgentError):
    """409: the agent understood and refused (a shrink below what is in use); nothing changed."""


class AgentNeedsPool(AgentRefused):
    """409 from a single-pool route of an agent that serves several models: its message names
    them and says to pick one (`--pool NAME`)."""


class AgentRequestError(AgentError):
    """Another 4xx: the request was wrong (a bad value); nothing changed."""


class AgentNoSuchPool(AgentRequestError):
    """404 from a named pool's route: the agent serves no such model; its message names those
    it serves."""


class AgentServerError(AgentError):
    """5xx: the agent failed while answering."""


class AgentProtocolError(AgentError):
    """The answer is not what a kvctl agent of this version sends."""


class AgentRouteMissing(AgentProtocolError):
    """404 from a kvctl agent for a route it does not have: an agent older than this kvctl."""


# ---- URLs and endpoints ---------------------------------------------------------------------


def normalize_url(text: str) -> str:
    """`node1`, `node1:9000` or `http://node1:9000/` as `http://node1:9000` (no trailing slash).

    A bare host gets the agent's default port, since that is what an operator typing a node
    name means. Raises ValueError for something that is not a URL.
    """
    raw = text.strip()
    if "://" not in raw:
        raw = f"http://{raw.rstrip('/')}"
        if raw.count(":") == 1:
            raw = f"{raw}:{DEFAULT_PORT}"
    raw = raw.rstrip("/")
    try:
        parts = urlsplit(raw)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as error:
        raise ValueError(
            f"{text!r} is not an agent URL ({error}); write e.g. {DEFAULT_AGENT}"
        ) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{text!r} is not an agent URL; write e.g. {DEFAULT_AGENT}")
    return raw


@dataclass(frozen=True)
class Endpoint(Generic[M]):
    """One route of the API: how to call it, what it answers and what to call it in messages."""

    method: str
    path: str
    model: type[M]
    action: str
    pool: str | None = None
    """The pool a `/v1/pools/{name}/...` route was given (see `named`)."""

    def named(self, pool: str) -> Endpoint[M]:
        """This route of the pool `pool` (the model it serves)."""
        return replace(self, path=self.path.format(name=quote(pool, safe="")), pool=pool)


HEALTH = Endpoint("GET", "/healthz", Health, "health check")
POOL = Endpoint("GET", "/v1/pool", PoolSnapshot, "pool read")
POOL_MAP = Endpoint("GET", "/v1/pool/map", PoolMap, "pool map read")
DEFRAG = Endpoint("POST", "/v1/defrag", DefragResult, "defrag")
RESIZE = Endpoint("POST", "/v1/pool/resize", ResizeResult, "resize")
POOLS = Endpoint("GET", "/v1/pools", PoolList, "pools read")
NAMED_POOL = Endpoint("GET", "/v1/pools/{name}", PoolSnapshot, "pool read")
NAMED_POOL_MAP = Endpoint("GET", "/v1/pools/{name}/map", PoolMap, "pool map read")
NAMED_DEFRAG = Endpoint("POST", "/v1/pools/{name}/defrag", DefragResult, "defrag")
NAMED_RESIZE = Endpoint("POST", "/v1/pools/{name}/resize", ResizeResult, "resize")
RELEASE = Endpoint("POST", "/v1/pools/{name}/release", PoolRelease, "release")
SLEEP = Endpoint("POST", "/v1/pools/{name}/sleep", SleepResult, "sleep")
WAKE = Endpoint("POST", "/v1/pools/{name}/wake", WakeResult, "wake")
ALERTS = Endpoint("GET", "/v1/alerts", AlertList, "alerts read")
CONFIG = Endpoint("GET", "/v1/config", RuntimeSettings, "config read")
CONFIG_PATCH = Endpoint("PATCH", "/v1/config", RuntimeSettings, "config change")
MODELS = Endpoint("GET", "/v1/models", ModelList, "models read")
COMPLETION = Endpoint("POST", "/v1/completions", CompletionResponse, "completion")
CHAT = Endpoint("POST", "/v1/chat/completions", BaseModel, "chat completion")
TOKENIZE = Endpoint("POST", "/v1/tokenize", TokenizeResponse, "tokenize")
PREFIX_LOOKUP = Endpoint("POST", "/v1/prefix/lookup", PrefixLookupResult, "prefix lookup")
PREFIX_LIST = Endpoint("GET", "/v1/prefix", PrefixListing, "prefix listing")
PREFIX_PIN = Endpoint("POST", "/v1/prefix/pins", PrefixPinView, "prefix pin")
PREFIX_UNPIN = Endpoint("DELETE", "/v1/prefix/pins/{name}", PrefixPinView, "prefix unpin")
PREFIX_MOVE = Endpoint("POST", "/v1/prefix/move", PrefixLookupResult, "prefix move")
PREFIX_CLEAR = Endpoint("POST", "/v1/prefix/clear", PrefixClearResult, "prefix clear")
METRICS = Endpoint("GET", "/metrics", BaseModel, "metrics read")
"""Text, not JSON: read by `AsyncAgentClient.metrics_text` for an engine's figures."""


def pool_route(single: Endpoint[M], named: Endpoint[M], pool: str | None) -> Endpoint[M]:
    """The route of the pool `pool`, or the agent's only pool when None (an agent with several
    answers that one with 409 naming them, which is how a command without `--pool` learns)."""
    return single if pool is None else named.named(pool)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for every client: httpx builds one per client otherwise, loading the CA
    bundle each time (about 19 ms), which was most of the time `kvctl status` took to read 200
    agents."""
    return httpx.create_ssl_context()


def request_headers(token: str | None) -> dict[str, str]:
    """What kvctl sends with every request: who it is, JSON, and the token when given."""
    headers = {"User-Agent": f"kvctl/{__version__}", "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _body(body: BaseModel | None) -> Any:
    if body is None:
        return None
    data = body.model_dump(mode="json", exclude_none=True)
    if isinstance(body, ResizeRequest) and body.tier == "device":
        # the device pool is what every agent resizes without `tier`; one from before tiers
        # refuses the field, so it is sent only for a host or disk tier
        del data["tier"]
    return data


# ---- turning answers into models or errors --------------------------------------------------


def transport_error(agent: str, error: httpx.TransportError, timeout: float) -> AgentError:
    """The one-line reason an agent could not be reached."""
    if isinstance(error, httpx.TimeoutException):
        return _no_answer(
            agent, f"did not answer within {timeout:g} s", f"no answer within {timeout:g} s"
        )
    reason = str(error).split("] ")[-1].strip().lower() or type(error).__name__
    return AgentUnreachable(
        agent,
        f"cannot reach agent at {agent} ({reason}); is kvctl-agent running? use --agent URL",
        reason=reason,
    )


def _no_answer(agent: str, what: str, reason: str) -> AgentUnreachable:
    return AgentUnreachable(
        agent,
        f"agent {agent} {what}; is it overloaded or stuck? check its log or raise --timeout",
        reason=reason,
    )


def limit_error(agent: str, error: ReadLimit) -> AgentError:
    """The one-line reason an answer was not read: too slow, too large or nested too deep;
    the node is shown as one that did not answer."""
    if isinstance(error, bounded_read.TooSlow):
        return _no_answer(agent, f"sent {error}", str(error))
    return AgentUnreachable(
        agent, f"{agent}: {error}, so it was not read; check --agent URL", reason=str(error)
    )


def _error_message(response: httpx.Response) -> str:
    body = _error_body(response)
    if body is not None:
        return body.error.message
    text = response.text.strip().splitlines()
    return text[0][:200] if text else response.reason_phrase


def _error_body(response: httpx.Response) -> ErrorBody | None:
    """The error body every kvctl agent sends with a 4xx/5xx, or None (someone else answered)."""
    try:
        check_depth(response.content)
        return ErrorBody.model_validate_json(response.content)
    except (ValidationError, ValueError, ReadLimit):
        return None


def not_an_agent(agent: str, what: str) -> NotAnAgent:
    return NotAnAgent(
        agent,
        f"{agent} answered, but not as a kvctl agent ({what}); check --agent URL or KVCTL_AGENT",
        reason=f"not a kvctl agent ({what})",
    )


def status_error(
    agent: str, endpoint: Endpoint[Any], response: httpx.Response, token: str | None
) -> AgentError:
    """The one-line reason an agent gave for not doing what `endpoint` asks."""
    code = response.status_code
    message = _error_message(response)
    body = _error_body(response)
    kind = body.error.type if body is not None else None
    if code in (401, 403):
        fix = (
            "the token was refused; check --token or KVCTL_TOKEN against the agent's --token-file"
            if token
            else "pass --token or set KVCTL_TOKEN"
        )
        return AgentUnauthorized(
            agent, f"agent {agent}: {code} unauthorized; {fix}", reason=f"{code} unauthorized"
        )
    if code == 409 and kind == POOL_REQUIRED:
        return AgentNeedsPool(agent, f"agent {agent}: {message}")
    if code == 409:
        said = message if message.startswith(f"{endpoint.action} refused") else None
        return AgentRefused(
            agent, f"agent {agent}: {said or f'{endpoint.action} refused: {message}'}"
        )
    if code in (404, 405) and body is None:
        return not_an_agent(agent, f"{code} {response.reason_phrase or ''}".strip())
    if code == 404 and kind == UNKNOWN_POOL:
        return AgentNoSuchPool(agent, f"agent {agent}: {message}")
    if code == 404 and kind == UNKNOWN_PREFIX_ITEM:
        return AgentRequestError(agent, f"agent {agent}: {message}")
    if code == 404:
        return AgentRouteMissing(
            agent,
            f"agent {agent}: {endpoint.method} {endpoint.path} not found ({message}); "
            "is this a kvctl agent as new as this kvctl? upgrade the agent",
        )
    if code < 500:
        return AgentRequestError(agent, f"agent {agent}: {endpoint.action} rejected: {message}")
    return AgentServerError(
        agent,
        f"agent {agent}: internal error {code} during {endpoint.action}: {message}; "
        "see the agent's log",
    )


def parse_answer(agent: str, endpoint: Endpoint[M], content: bytes | str) -> M:
    """A 2xx body as `endpoint.model`, or an AgentProtocolError saying what was off."""
    try:
        check_depth(content)
    except ReadLimit as error:
        raise limit_error(agent, error) from None
    try:
        return endpoint.model.model_validate_json(content)
    except ValidationError as error:
        first = error.errors()[0]
        if first["type"] == "json_invalid":  # not JSON at all: a web page, another service
            raise not_an_agent(agent, f"the answer to {endpoint.path} is not JSON") from None
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise AgentProtocolError(
            agent,
            f"agent {agent}: unexpected answer to {endpoint.method} {endpoint.path} "
            f"({where}: {first['msg']}); is it a kvctl agent of a matching version?",
        ) from None


def _event(agent: str, line: str, what: str) -> tuple[str, Any] | None:
    """One server-sent event line as (data, its JSON or None); None for keep-alives and [DONE].
    An error event raises: the agent failed the request after the stream began."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if not data or data == "[DONE]":
        return None
    try:
        payload = json.loads(data)
    except ValueError:
        payload = None
    if isinstance(payload, dict) and "error" in payload:
        message = ErrorBody.model_validate(payload).error.message
        raise AgentServerError(agent, f"agent {agent}: {what} failed mid-stream: {message}")
    return data, payload


def parse_event(agent: str, line: str) -> CompletionResponse | None:
    """One server-sent event line of a streamed completion; None for keep-alives and [DONE]."""
    event = _event(agent, line, "completion")
    return None if event is None else parse_answer(agent, COMPLETION, event[0])


def parse_chat_event(agent: str, line: str) -> dict[str, Any] | None:
    """One server-sent event line of a streamed chat completion as a JSON object (its
    `choices[].delta` and `usage`); None for keep-alives and [DONE]."""
    event = _event(agent, line, "chat completion")
    if event is None:
        return None
    if not isinstance(event[1], dict):
        raise not_an_agent(agent, "a chat stream event is not a JSON object")
    return event[1]


def _check(
    agent: str, endpoint: Endpoint[Any], response: httpx.Response, token: str | None
) -> None:
    if response.status_code >= 400:
        raise status_error(agent, endpoint, response, token)


# ---- the clients ----------------------------------------------------------------------------


class AgentClient:
    """One agent, synchronously; use as a context manager or call `close()`."""

    def __init__(
        self,
        url: str = DEFAULT_AGENT,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = normalize_url(url)
        self.token = token
        self.timeout = timeout
        self._http = httpx.Client(
            base_url=self.url,
            headers=request_headers(token),
            timeout=timeout,
            transport=transport,
            verify=tls_context(),
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(
        self, method: str, path: str, json: Any = None, cap: int = MAX_JSON_BYTES
    ) -> httpx.Response:
        """One exchange, read whole within the timeout and `cap` bytes."""
        request = self._http.build_request(method, path, json=json)
        try:
            return bounded_read.read(self._http, request, self.timeout, cap)
        except httpx.TransportError as error:
            raise transport_error(self.url, error, self.timeout) from None
        except ReadLimit as error:
            raise limit_error(self.url, error) from None

    def _call(self, endpoint: Endpoint[M], body: BaseModel | None = None) -> M:
        response = self._send(endpoint.method, endpoint.path, _body(body))
        _check(self.url, endpoint, response, self.token)
        return parse_answer(self.url, endpoint, response.content)

    def health(self) -> Health:
        return self._call(HEALTH)

    def pools(self) -> PoolList:
        """Every pool of the agent with the budget they share; from an agent older than
        several models, its one pool."""
        try:
            return self._call(POOLS)
        except AgentRouteMissing:
            return PoolList(pools=[self.pool()])

    def pool(self, pool: str | None = None) -> PoolSnapshot:
        """The pool of model `pool`, or the only one (AgentNeedsPool when there are several)."""
        return self._call(pool_route(POOL, NAMED_POOL, pool))

    def pool_map(self, pool: str | None = None) -> PoolMap:
        return self._call(pool_route(POOL_MAP, NAMED_POOL_MAP, pool))

    def defrag(self, max_pages: int | None = None, pool: str | None = None) -> DefragResult:
        return self._call(
            pool_route(DEFRAG, NAMED_DEFRAG, pool), DefragRequest(max_pages=max_pages)
        )

    def resize(self, request: ResizeRequest, pool: str | None = None) -> ResizeResult:
        return self._call(pool_route(RESIZE, NAMED_RESIZE, pool), request)

    def release(self, pool: str) -> PoolRelease:
        """Hand a pool pinned by a resize back to the agent's rebalancing."""
        return self._call(RELEASE.named(pool))

    def sleep(self, pool: str, request: SleepRequest) -> SleepResult:
        """Put model `pool` to sleep: its KV pool (and at level 2 its weights) released."""
        return self._call(SLEEP.named(pool), request)

    def wake(self, pool: str) -> WakeResult:
        """Wake model `pool`; answers once it can serve."""
        return self._call(WAKE.named(pool))

    def alerts(self) -> AlertList:
        return self._call(ALERTS)

    def config(self) -> RuntimeSettings:
        return self._call(CONFIG)

    def patch_config(self, patch: RuntimeSettingsPatch) -> RuntimeSettings:
        return self._call(CONFIG_PATCH, patch)

    def models(self) -> ModelList:
        return self._call(MODELS)

    def complete(self, request: CompletionRequest) -> CompletionResponse:
        return self._call(COMPLETION, request.model_copy(update={"stream": False}))

    def prefix_lookup(self, query: PrefixQuery) -> PrefixLookupResult:
        return self._call(PREFIX_LOOKUP, query)

    def prefix_listing(self, model: str | None = None) -> PrefixListing:
        if model is None:
            return self._call(PREFIX_LIST)
        return self._call(replace(PREFIX_LIST, path=f"/v1/prefix?model={quote(model, safe='')}"))

    def prefix_pin(self, request: PrefixPinRequest) -> PrefixPinView:
        return self._call(PREFIX_PIN, request)

    def prefix_unpin(self, pin_id: str) -> PrefixPinView:
        return self._call(replace(PREFIX_UNPIN, path=f"/v1/prefix/pins/{quote(pin_id, safe='')}"))

    def prefix_move(self, request: PrefixMoveRequest) -> PrefixLookupResult:
        return self._call(PREFIX_MOVE, request)

    def prefix_clear(self, request: PrefixClearRequest) -> PrefixClearResult:
        return self._call(PREFIX_CLEAR, request)

    def send_test_alert(self) -> dict[str, Any]:
        """POST /v1/alerts/test: the agent sends a test alert to its Alertmanager with its own
        labels and credentials (and audits it); returns `{"sent": true, "alert": {...}}`."""
        endpoint = Endpoint("POST", "/v1/alerts/test", BaseModel, "alert test")
        response = self._send(endpoint.method, endpoint.path)
        _check(self.url, endpoint, response, self.token)
        try:
            check_depth(response.content)
        except ReadLimit as error:
            raise limit_error(self.url, error) from None
        return response.json()

    def metrics(self) -> str:
        """The Prometheus exposition text of GET /metrics."""
        response = self._send(METRICS.method, METRICS.path, cap=MAX_EXPOSITION_BYTES)
        _check(self.url, METRICS, response, self.token)
        return response.text

    def stream_completion(self, request: CompletionRequest) -> Iterator[CompletionResponse]:
        """The chunks of a streamed completion as they arrive, ending at `data: [DONE]`."""
        body = _body(request.model_copy(update={"stream": True}))
        try:
            with self._http.stream("POST", COMPLETION.path, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise status_error(self.url, COMPLETION, response, self.token)
                for line in response.iter_lines():
                    chunk = parse_event(self.url, line)
                    if chunk is not None:
                        yield chunk
        except httpx.TransportError as error:
            raise transport_error(self.url, error, self.timeout) from None


class AsyncAgentClient:
    """One agent, as coroutines: the TUI polls and the load generator drives without blocking."""

    def __init__(
        self,
        url: str = DEFAULT_AGENT,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = normalize_url(url)
        self.token = token
        self.timeout = timeout
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=request_headers(token),
            timeout=timeout,
            transport=transport,
            verify=tls_context(),
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(
        self,
        request: httpx.Request,
        cap: int = MAX_JSON_BYTES,
        sink: Sink | None = None,
    ) -> httpx.Response:
        """One exchange, read whole within the timeout and `cap` bytes (a 2xx body into
        `sink` where given)."""
        try:
            return await bounded_read.aread(self._http, request, self.timeout, cap, sink)
        except httpx.TransportError as error:
            raise transport_error(self.url, error, self.timeout) from None
        except ReadLimit as error:
            raise limit_error(self.url, error) from None

    async def _call(self, endpoint: Endpoint[M], body: BaseModel | None = None) -> M:
        request = self._http.build_request(endpoint.method, endpoint.path, json=_body(body))
        response = await self._send(request)
        _check(self.url, endpoint, response, self.token)
        return parse_answer(self.url, endpoint, response.content)

    async def health(self) -> Health:
        return await self._call(HEALTH)

    async def exposition(self, path: str = METRICS.path) -> Exposition:
        """The node's exposition at `path` (a kvctl agent's or an engine's), parsed as it
        arrives; ExpositionError where it is not one."""
        reader = ExpositionReader()
        request = self._http.build_request("GET", path, headers={"Accept": "text/plain"})
        response = await self._send(request, MAX_EXPOSITION_BYTES, reader.feed)
        _check(self.url, METRICS, response, self.token)
        return reader.close()

    async def pools(self) -> PoolList:
        """Every pool of the agent with the budget they share; from an agent older than
        several models, its one pool."""
        try:
            return await self._call(POOLS)
        except AgentRouteMissing:
            return PoolList(pools=[await self.pool()])

    async def pool(self, pool: str | None = None) -> PoolSnapshot:
        """The pool of model `pool`, or the only one (AgentNeedsPool when there are several)."""
        return await self._call(pool_route(POOL, NAMED_POOL, pool))

    async def pool_map(self, pool: str | None = None) -> PoolMap:
        return await self._call(pool_route(POOL_MAP, NAMED_POOL_MAP, pool))

    async def defrag(self, max_pages: int | None = None, pool: str | None = None) -> DefragResult:
        request = DefragRequest(max_pages=max_pages)
        return await self._call(pool_route(DEFRAG, NAMED_DEFRAG, pool), request)

    async def resize(self, request: ResizeRequest, pool: str | None = None) -> ResizeResult:
        return await self._call(pool_route(RESIZE, NAMED_RESIZE, pool), request)

    async def release(self, pool: str) -> PoolRelease:
        """Hand a pool pinned by a resize back to the agent's rebalancing."""
        return await self._call(RELEASE.named(pool))

    async def alerts(self) -> AlertList:
        return await self._call(ALERTS)

    async def config(self) -> RuntimeSettings:
        return await self._call(CONFIG)

    async def models(self) -> ModelList:
        return await self._call(MODELS)

    async def stream_completion(
        self, request: CompletionRequest
    ) -> AsyncIterator[CompletionResponse]:
        """The chunks of a streamed completion as they arrive, ending at `data: [DONE]`."""
        async for chunk in self._stream(COMPLETION, request, parse_event):
            yield chunk

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        return await self._call(TOKENIZE, request)

    async def stream_chat(self, request: ChatCompletionRequest) -> AsyncIterator[dict[str, Any]]:
        """The chunks of a streamed chat completion as JSON objects, ending at `data: [DONE]`."""
        async for chunk in self._stream(CHAT, request, parse_chat_event):
            yield chunk

    async def _stream(
        self, endpoint: Endpoint[Any], request: BaseModel, parse: Callable[[str, str], T | None]
    ) -> AsyncIterator[T]:
        body = _body(request.model_copy(update={"stream": True}))
        try:
            async with self._http.stream("POST", endpoint.path, json=body) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise status_error(self.url, endpoint, response, self.token)
                async for line in response.aiter_lines():
                    chunk = parse(self.url, line)
                    if chunk is not None:
                        yield chunk
        except httpx.TransportError as error:
            raise transport_error(self.url, error, self.timeout) from None
