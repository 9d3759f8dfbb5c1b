"""The route handlers called alone, with a context of the test's own: a fake service whose pools
run their actions at once and record them, no engine, no HTTP. What only a real agent shows
(status codes through the middleware, bodies over the wire) is in test_agent_http.py and its
siblings; here each handler's own decisions: which pool, which action, what is audited."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from pool_readings import pool_snapshot, tier_reading
from starlette.requests import Request

from kvctl import api
from kvctl.agent.config import AgentConfig
from kvctl.agent.generation import Refusal
from kvctl.agent.http.audit import AuditLog
from kvctl.agent.http.context import ApiError, ServerContext, context
from kvctl.agent.http.routes import (
    alerts,
    completions,
    health,
    metrics,
    models,
    pools,
    runbook,
    settings,
    tokenize,
)
from kvctl.agent.http.server import ROUTERS
from kvctl.agent.observe.metrics import Histograms
from kvctl.agent.observe.tally import Tally
from kvctl.agent.pool import PoolError
from kvctl.agent.served import ServedModel
from kvctl.agent.service import AgentService
from kvctl.api import (
    CompletionRequest,
    DefragRequest,
    DefragResult,
    ResizeRequest,
    ResizeResult,
    RuntimeSettings,
    TokenizeRequest,
)

BYTES_PER_PAGE = 65536  # pool_snapshot's


class FakeService:
    """The part of `AgentService` the handlers use; commands, its own and its pools' actions,
    run at once and are recorded."""

    pool = AgentService.pool  # the real lookup, so 404 and 409 name the pools as an agent does
    names = AgentService.names

    def __init__(self, *names: str, refuse: Exception | None = None) -> None:
        self.commands: list[tuple[Any, ...]] = []
        self.refuse = refuse
        self.pools = {name: FakePool(self, name) for name in names}
        self.budget = None
        self.settings = RuntimeSettings()
        self.alerting = None
        self.alerts: list = []
        self.kv_events = None
        self.accepting = True
        self.admin_actions = Tally()

    @property
    def snapshots(self) -> list:
        return [pool.snapshot for pool in self.pools.values()]

    def uptime(self) -> float:
        return 12.5

    def call(self, fn: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn())
        except Exception as error:
            future.set_exception(error)
        return future

    def _run(self, *command: Any) -> None:
        self.commands.append(command)
        if self.refuse is not None:
            raise self.refuse

    def change_settings(self, changes: object) -> tuple[RuntimeSettings, RuntimeSettings]:
        self._run("change_settings", changes)
        before = self.settings
        self.settings = before.model_copy(
            update={"alerts": before.alerts.model_copy(update={"interval_s": 5.0})}
        )
        return before, self.settings


class FakePool:
    """The part of `ModelPool` the handlers use; its actions are recorded on the service's list,
    with the pool's name last."""

    def __init__(self, service: FakeService, name: str, tiers: list | None = None) -> None:
        self.service = service
        self.name = name
        self.snapshot = pool_snapshot(pool=name, tiers=tiers or [])
        self.served = ServedModel((name, f"{name}-alias"), None, 4096)
        self.histograms = Histograms()
        self.rejected = Tally()
        self.engine = SimpleNamespace(tokenizer=None)

    def defrag_now(self, max_pages: int | None) -> DefragResult:
        self.service._run("defrag_now", max_pages, self.name)
        return DefragResult(
            trigger="manual",
            fragmentation_before=0.4,
            fragmentation_after=0.0,
            free_extents_before=3,
            free_extents_after=1,
            pages_moved=7,
            bytes_moved=7 * BYTES_PER_PAGE,
            seconds=0.01,
            complete=True,
        )

    def resize(self, pages: int) -> ResizeResult:
        self.service._run("resize", pages, self.name)
        return resized(pages, "device", self.name)

    def resize_tier(self, tier: str, pages: int) -> ResizeResult:
        self.service._run("resize_tier", tier, pages, self.name)
        return resized(pages, tier, self.name)

    def release(self) -> bool:
        self.service._run("release", self.name)
        return True


def resized(pages: int, tier: str, name: str | None) -> ResizeResult:
    return ResizeResult(
        old_pages=512,
        new_pages=pages,
        old_bytes=512 * BYTES_PER_PAGE,
        new_bytes=pages * BYTES_PER_PAGE,
        direction="grow" if pages > 512 else "shrink",
        pages_moved=0,
        pages_evicted=0,
        tier=tier,
        pool=name,
    )


def make_context(*names: str, **service: Any) -> ServerContext:
    fake: Any = FakeService(*names, **service)
    return ServerContext(fake, AgentConfig(), "http://node-1:8477", AuditLog(fake.admin_actions))


def request(method: str = "POST", path: str = "/v1/defrag", body: bytes = b"") -> Request:
    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [],
        "query_string": b"",
        "client": ("10.0.0.7", 51234),
    }
    return Request(scope, receive)


def run(awaitable: Any) -> Any:
    return asyncio.run(awaitable)


def refused(awaitable: Any) -> ApiError:
    """The HTTP error a handler ends with: its own, or a generation's refusal as the server's
    handler answers it (same status, message, headers, type and field)."""
    with pytest.raises((ApiError, Refusal)) as caught:
        run(awaitable)
    error = caught.value
    if isinstance(error, Refusal):
        return ApiError(error.status, error.message, error.headers, error.error_type, error.param)
    return error


@pytest.fixture
def audit(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """The audit lines, in `audit.messages`."""
    caplog.set_level(logging.INFO, logger="kvctl.audit")
    return caplog


# ---- the wiring ---------------------------------------------------------------------------


def test_every_handler_is_a_module_level_function_of_a_route_module() -> None:
    routes = [route for router in ROUTERS for route in router.routes]
    assert len(routes) == 29
    for route in routes:
        assert isinstance(route, APIRoute)
        assert route.endpoint.__module__.startswith("kvctl.agent.http.routes."), route.path
        assert "<locals>" not in route.endpoint.__qualname__, route.path


def test_the_context_is_the_applications() -> None:
    app = FastAPI()
    app.state.context = make_context("demo")
    scope = {"type": "http", "app": app, "headers": [], "method": "GET", "path": "/"}
    assert context(Request(scope)) is app.state.context


# ---- health, pools ------------------------------------------------------------------------


def test_health_names_every_pool_and_the_first_as_pool() -> None:
    answer = run(health.healthz(make_context("a", "b")))
    assert (answer.pool, answer.pools, answer.uptime_seconds) == ("a", ["a", "b"], 12.5)


def test_the_only_pool_is_served_without_a_name() -> None:
    ctx = make_context("demo")
    assert run(pools.pool(ctx)).pool == "demo"
    assert [s.pool for s in run(pools.pools(ctx)).pools] == ["demo"]
    assert run(pools.named_pool("demo-alias", ctx)).pool == "demo"


def test_a_single_pool_route_on_several_pools_asks_for_a_name() -> None:
    error = refused(pools.pool(make_context("a", "b")))
    assert (error.status_code, error.error_type) == (409, api.POOL_REQUIRED)
    assert "name one: /v1/pools/NAME" in error.detail


def test_an_unknown_pool_is_404_naming_those_served() -> None:
    error = refused(pools.named_pool("nope", make_context("a", "b")))
    assert (error.status_code, error.error_type) == (404, api.UNKNOWN_POOL)
    assert "'a', 'a-alias', 'b', 'b-alias'" in error.detail


# ---- pool actions: route -> the pool's action on the engine thread, audited --------------


def test_defrag_is_the_named_pools_action(audit) -> None:
    ctx = make_context("a", "b")
    result = run(pools.named_defrag(request(), "b-alias", ctx, DefragRequest(max_pages=9)))
    assert result.pages_moved == 7
    assert ctx.service.commands == [("defrag_now", 9, "b")]
    [line] = audit.messages
    assert line.startswith("audit action=defrag outcome=ok caller=10.0.0.7:51234")
    assert '"max_pages": 9' in line and '"pool": "b"' in line
    assert ctx.service.admin_actions.read() == {"defrag": 1}


def test_defrag_of_the_only_pool_without_a_body() -> None:
    ctx = make_context("demo")
    run(pools.defrag(request(), ctx))
    assert ctx.service.commands == [("defrag_now", None, "demo")]


def test_a_device_resize_in_bytes_rounds_up_to_a_page(audit) -> None:
    ctx = make_context("demo")
    body = ResizeRequest(bytes=3 * BYTES_PER_PAGE + 1)
    result = run(pools.resize(request(path="/v1/pool/resize"), body, ctx))
    assert result.new_pages == 4
    assert ctx.service.commands == [("resize", 4, "demo")]
    assert audit.messages[0].startswith("audit action=resize outcome=ok")


def test_a_tier_resize_in_bytes_rounds_down_to_the_tiers_page() -> None:
    ctx = make_context("demo")
    ctx.service.pools["demo"] = FakePool(ctx.service, "demo", tiers=[tier_reading("host")])
    body = ResizeRequest(tier="host", bytes=3 * BYTES_PER_PAGE + 1)
    run(pools.named_resize(request(), "demo", body, ctx))
    assert ctx.service.commands == [("resize_tier", "host", 3, "demo")]


def test_a_tier_the_pool_lacks_is_409_before_any_command(audit) -> None:
    ctx = make_context("demo")
    error = refused(pools.resize(request(), ResizeRequest(tier="disk", pages=8), ctx))
    assert error.status_code == 409 and "no disk tier" in error.detail
    assert ctx.service.commands == [] and audit.messages == []


def test_a_refused_resize_is_409_and_audited(audit) -> None:
    ctx = make_context("demo", refuse=PoolError("below one segment"))
    error = refused(pools.resize(request(), ResizeRequest(pages=1), ctx))
    assert (error.status_code, error.detail) == (409, "resize refused: below one segment")
    [line] = audit.messages
    assert "outcome=refused" in line and '"reason": "below one segment"' in line
    assert ctx.service.admin_actions.read() == {}


def test_release_is_the_named_pools_action() -> None:
    ctx = make_context("a", "b")
    answer = run(pools.release(request(), "a", ctx))
    assert (answer.pool, answer.was_pinned) == ("a", True)
    assert ctx.service.commands == [("release", "a")]


def test_a_refused_release_is_409(audit) -> None:
    ctx = make_context("demo", refuse=ValueError("this pool shares no budget"))
    error = refused(pools.release(request(), "demo", ctx))
    assert (error.status_code, error.detail) == (409, "this pool shares no budget")
    assert "action=release outcome=refused" in audit.messages[0]


# ---- alerts, settings, models, metrics, runbook -------------------------------------------


def test_a_test_alert_without_alerting_is_409_and_audited(audit) -> None:
    ctx = make_context("demo")
    assert run(alerts.alerts(ctx)).alerts == []
    error = refused(alerts.alert_test(request(), ctx))
    assert (error.status_code, error.detail) == (409, "this agent evaluates no alerts")
    assert "action=alert_test outcome=refused" in audit.messages[0]


def test_a_settings_change_is_applied_on_the_engine_and_audited(audit) -> None:
    ctx = make_context("demo")
    body = b'{"alerts": {"interval_s": 5}}'
    answer = run(settings.patch_config(request("PATCH", "/v1/config", body), ctx))
    assert answer.alerts.interval_s == 5.0
    assert ctx.service.commands == [("change_settings", {"alerts": {"interval_s": 5}})]
    assert '"alerts.interval_s": [15.0, 5.0]' in audit.messages[0]
    assert run(settings.get_config(ctx)) is answer


def test_a_settings_body_that_is_not_json_changes_nothing() -> None:
    ctx = make_context("demo")
    error = refused(settings.patch_config(request("PATCH", "/v1/config", b"{"), ctx))
    assert error.status_code == 422 and error.detail.startswith("the body is not valid JSON")
    lone = refused(settings.patch_config(request("PATCH", "/v1/config", b'{"\\ud800": 1}'), ctx))
    assert lone.status_code == 400
    assert ctx.service.commands == []


def test_changed_lists_only_what_changed() -> None:
    before = RuntimeSettings()
    assert settings.changed(before, before) == {}
    after = before.model_copy(
        update={"alerts": before.alerts.model_copy(update={"interval_s": 5.0})}
    )
    assert settings.changed(before, after) == {"alerts.interval_s": [15.0, 5.0]}


def test_every_served_name_is_a_model_card() -> None:
    ctx = make_context("a", "b")
    cards = run(models.models(ctx)).data
    assert [(c.id, c.root) for c in cards] == [
        ("a", "a"),
        ("a-alias", "a"),
        ("b", "b"),
        ("b-alias", "b"),
    ]
    assert {c.created for c in cards} == {int(ctx.started_wall)}


def test_metrics_expose_every_pool() -> None:
    answer = run(metrics.metrics(make_context("a", "b")))
    text = answer.body.decode()
    assert 'pool="a"' in text and 'pool="b"' in text


def test_the_runbook_is_markdown() -> None:
    answer = run(runbook.runbook())
    assert answer.media_type.startswith("text/markdown")
    assert answer.body.startswith(b"#")


# ---- tokenize, completions ----------------------------------------------------------------


def test_tokenize_needs_a_model_when_several_are_served() -> None:
    ctx = make_context("a", "b")
    error = refused(tokenize.tokenize(TokenizeRequest(prompt="hi"), ctx))
    assert (error.status_code, error.error_type) == (400, "model_required")
    error = refused(tokenize.tokenize(TokenizeRequest(model="c", prompt="hi"), ctx))
    assert (error.status_code, error.error_type) == (404, "model_not_found")
    error = refused(tokenize.tokenize(TokenizeRequest(model="b", prompt="hi"), ctx))
    assert error.status_code == 400 and "no tokenizer" in error.detail


def test_a_draining_agent_refuses_completions_counted_on_the_first_pool() -> None:
    ctx = make_context("a", "b")
    ctx.service.accepting = False
    body = CompletionRequest(model="b", prompt="hi")
    error = refused(completions.completions(body, request(path="/v1/completions"), ctx))
    assert (error.status_code, error.detail) == (503, "the agent is shutting down")
    assert ctx.service.pools["a"].rejected.read() == {"shutting_down": 1}
    assert ctx.service.pools["b"].rejected.read() == {}
