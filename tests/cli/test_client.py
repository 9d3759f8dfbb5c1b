"""The client turns every failure into one line that names the agent and says what to do.

Answers come from httpx.MockTransport (no socket), except the refused connection, which is real.
"""

from __future__ import annotations

import json

import httpx
import pytest
from pool_readings import pool_snapshot

from kvctl.api import ResizeRequest
from kvctl.client import (
    AgentClient,
    AgentNeedsPool,
    AgentNoSuchPool,
    AgentProtocolError,
    AgentRefused,
    AgentRequestError,
    AgentRouteMissing,
    AgentServerError,
    AgentUnauthorized,
    AgentUnreachable,
    NotAnAgent,
    normalize_url,
    parse_event,
)

URL = "http://agent.test:8477"


def answering(status: int, body: object, seen: list[httpx.Request] | None = None) -> AgentClient:
    def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        return httpx.Response(status, json=body)

    return AgentClient(URL, token="t0k", transport=httpx.MockTransport(handle))


def error(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("node1", "http://node1:8477"),
        ("node1:9000", "http://node1:9000"),
        ("http://node1:9000/", "http://node1:9000"),
        ("https://kv.example/", "https://kv.example"),
        (" 127.0.0.1:8477 ", "http://127.0.0.1:8477"),
    ],
)
def test_normalize_url(text, url) -> None:
    assert normalize_url(text) == url


@pytest.mark.parametrize("text", ["http://", "ftp://node1", "node1:port"])
def test_normalize_url_refuses_with_an_example(text) -> None:
    with pytest.raises(ValueError, match=r"http://127.0.0.1:8477"):
        normalize_url(text)


def test_token_goes_in_the_authorization_header() -> None:
    seen: list[httpx.Request] = []
    with pytest.raises(AgentProtocolError):  # the body is not a DefragResult
        answering(200, {}, seen).defrag(max_pages=3)
    assert seen[0].headers["Authorization"] == "Bearer t0k"
    assert json.loads(seen[0].content) == {"max_pages": 3}


def test_resize_sends_only_the_given_field() -> None:
    seen: list[httpx.Request] = []
    with pytest.raises(AgentProtocolError):
        answering(200, {}, seen).resize(ResizeRequest(pages=64))
    assert json.loads(seen[0].content) == {"pages": 64}  # no `tier`: older agents refuse it


def test_resize_of_a_tier_names_it() -> None:
    seen: list[httpx.Request] = []
    with pytest.raises(AgentProtocolError):
        answering(200, {}, seen).resize(ResizeRequest(tier="host", bytes=1 << 30))
    assert json.loads(seen[0].content) == {"tier": "host", "bytes": 1 << 30}


def test_401_with_a_token_says_to_check_it() -> None:
    with pytest.raises(AgentUnauthorized) as caught:
        answering(401, error("missing or wrong token", "unauthorized", 401)).pool()
    assert str(caught.value) == (
        f"agent {URL}: 401 unauthorized; the token was refused; check --token or KVCTL_TOKEN "
        "against the agent's --token-file"
    )


def test_401_without_a_token_says_to_pass_one() -> None:
    client = AgentClient(URL, transport=httpx.MockTransport(lambda r: httpx.Response(401)))
    with pytest.raises(AgentUnauthorized, match=r"pass --token or set KVCTL_TOKEN$"):
        client.health()


def test_409_keeps_the_agents_reason() -> None:
    body = error("12 pages in use above the new size 256; defragment or wait", "conflict", 409)
    with pytest.raises(AgentRefused) as caught:
        answering(409, body).resize(ResizeRequest(pages=256))
    assert str(caught.value) == (
        f"agent {URL}: resize refused: 12 pages in use above the new size 256; defragment or wait"
    )


def test_409_does_not_repeat_refused() -> None:
    body = error("resize refused: the pool is at its maximum", "conflict", 409)
    with pytest.raises(AgentRefused) as caught:
        answering(409, body).resize(ResizeRequest(pages=9999))
    assert str(caught.value) == f"agent {URL}: resize refused: the pool is at its maximum"


def test_400_and_500_are_one_line() -> None:
    with pytest.raises(AgentRequestError, match=r"defrag rejected: max_pages: bad$"):
        answering(400, error("max_pages: bad", "invalid_request_error", 400)).defrag()
    with pytest.raises(AgentServerError) as caught:
        answering(500, error("IndexError\nTraceback ...", "internal", 500)).pool()
    assert "\n" not in str(caught.value)
    assert str(caught.value).endswith("see the agent's log")


def test_something_that_is_not_an_agent_is_a_wrong_url() -> None:
    """Another server at the URL reads like no agent there (exit 3), not like an old agent."""
    with pytest.raises(NotAnAgent, match=r"not as a kvctl agent \(404 Not Found\); check --agent"):
        answering(404, {"detail": "Not Found"}).pool_map()
    web_page = httpx.MockTransport(lambda r: httpx.Response(200, text="<html>welcome</html>"))
    with pytest.raises(NotAnAgent, match=r"/healthz is not JSON"):
        AgentClient(URL, transport=web_page).health()
    assert issubclass(NotAnAgent, AgentUnreachable)


def test_an_agent_that_lacks_an_endpoint_or_answers_differently_is_a_version_mismatch() -> None:
    with pytest.raises(AgentProtocolError, match=r"not found .*upgrade the agent"):
        answering(404, error("no such route", "not_found", 404)).pool_map()
    with pytest.raises(AgentProtocolError, match=r"unexpected answer to GET /healthz"):
        answering(200, {"hello": "world"}).health()


def test_refused_connection_names_the_agent_and_the_fix() -> None:
    with (
        AgentClient("http://127.0.0.1:9", timeout=2) as client,
        pytest.raises(AgentUnreachable) as caught,
    ):
        client.pool()
    message = str(caught.value)
    assert message.startswith("cannot reach agent at http://127.0.0.1:9 (")
    assert message.endswith("is kvctl-agent running? use --agent URL")


def test_timeout_says_how_long_it_waited() -> None:
    def hang(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    client = AgentClient(URL, timeout=1.5, transport=httpx.MockTransport(hang))
    with pytest.raises(AgentUnreachable, match=r"did not answer within 1\.5 s"):
        client.alerts()


def test_stream_events() -> None:
    chunk = {
        "id": "c1",
        "created": 1,
        "model": "demo",
        "choices": [{"text": "a", "finish_reason": None}],
    }
    assert parse_event(URL, "data: " + json.dumps(chunk)).choices[0].text == "a"
    assert parse_event(URL, "data: [DONE]") is None
    assert parse_event(URL, ": keep-alive") is None
    with pytest.raises(AgentServerError, match=r"mid-stream: out of pages"):
        parse_event(URL, "data: " + json.dumps(error("out of pages", "internal", 500)))


# ---- several pools ----------------------------------------------------------------------------


def test_named_pool_routes_quote_the_name() -> None:
    seen: list[httpx.Request] = []
    client = answering(200, {}, seen)
    for call in (
        lambda: client.pool("a b"),
        lambda: client.pool_map("a b"),
        lambda: client.defrag(4, pool="a b"),
        lambda: client.resize(ResizeRequest(pages=64), pool="a b"),
        lambda: client.release("a b"),
    ):
        with pytest.raises(AgentProtocolError):  # `{}` is none of the models
            call()
    assert [(r.method, r.url.raw_path.decode()) for r in seen] == [
        ("GET", "/v1/pools/a%20b"),
        ("GET", "/v1/pools/a%20b/map"),
        ("POST", "/v1/pools/a%20b/defrag"),
        ("POST", "/v1/pools/a%20b/resize"),
        ("POST", "/v1/pools/a%20b/release"),
    ]
    assert json.loads(seen[3].content) == {"pages": 64}


def test_a_single_pool_route_of_several_models_says_to_name_one() -> None:
    message = (
        "this agent serves several models ('small', 'big'); name one: /v1/pools/NAME "
        "(kvctl: --pool NAME)"
    )
    with pytest.raises(AgentNeedsPool) as caught:
        answering(409, error(message, "pool_required", 409)).defrag()
    assert str(caught.value) == f"agent {URL}: {message}"  # no "defrag refused:" before it
    assert isinstance(caught.value, AgentRefused)
    with pytest.raises(AgentRefused) as refused:  # any other 409 is a refusal of the action
        answering(409, error("the pool is busy", "conflict", 409)).defrag()
    assert not isinstance(refused.value, AgentNeedsPool)


def test_an_unknown_pool_is_named_with_the_ones_served() -> None:
    message = "model 'nope' is not served here; this agent serves 'small', 'big'"
    with pytest.raises(AgentNoSuchPool) as caught:
        answering(404, error(message, "unknown_pool", 404)).pool("nope")
    assert str(caught.value) == f"agent {URL}: {message}"


def test_an_agent_without_named_pools_is_too_old_not_missing_a_pool() -> None:
    with pytest.raises(AgentRouteMissing, match=r"/v1/pools/demo/release not found"):
        answering(404, error("Not Found", "not_found", 404)).release("demo")


def test_pools_of_an_agent_older_than_several_models_is_its_one_pool() -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/pools":
            return httpx.Response(404, json=error("Not Found", "not_found", 404))
        return httpx.Response(200, json=pool_snapshot().model_dump(mode="json"))

    listing = AgentClient(URL, transport=httpx.MockTransport(handle)).pools()
    assert [pool.pool for pool in listing.pools] == ["demo"]
    assert listing.budget_bytes is None
    assert [r.url.path for r in seen] == ["/v1/pools", "/v1/pool"]
