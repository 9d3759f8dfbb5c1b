"""A real stall, in process: the agent's service over the demo model with a scheduler that cannot
admit (what the old scheduler did with a pool full of cached pages), requests queued, time
stepped on an injected clock. The snapshot's stall and wait grow, and the agent's own alert loop
fires KvctlQueueStalled and KvctlQueueWaitLong with the cause it reads from the pool. The same
load on a working scheduler finishes and raises neither.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from kv_device import DEVICE
from one_pool import one_pool_service

from kvctl import api
from kvctl.agent.model import SamplingParams
from kvctl.agent.observe.alerting import AlertLoop
from kvctl.agent.runtime import Engine, EngineConfig, Scheduler
from kvctl.agent.service import AgentService
from kvctl.alerts import AlertEvaluator
from kvctl.settings import DefragSettings

AGENT = "http://node-1:8477"
STEP_S = 2.0
STEPS = 15  # 30 s of agent time
LOAD = [list(range(10 * i + 1, 10 * i + 13)) for i in range(6)]  # 6 prompts of 12 tokens
SETTINGS = api.RuntimeSettings(
    alerts=api.AlertSettings(for_s=0, queue_stalled_max_s=10, queue_wait_max_s=20)
)


class Clock:
    """Agent time, moved by the test; read by the engine thread."""

    def __init__(self) -> None:
        self.now = 1_000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


@pytest.fixture
def stack(demo) -> Iterator[tuple[AgentService, AlertLoop, Clock]]:
    """A running service on a 64-page pool (4 tokens a page), and its alert loop."""
    _, model, tokenizer = demo
    clock = Clock()
    config = EngineConfig(
        device=DEVICE,
        page_size=4,
        pool_pages=64,
        segment_pages=16,
        max_pool_pages=128,
        defrag=DefragSettings(enabled=False),
    )
    engine = Engine(model, tokenizer, config, clock=clock)
    service = one_pool_service(engine, SETTINGS, clock=clock, wall_clock=clock, window=60)
    evaluator = AlertEvaluator(
        service.settings, "demo", "node-1:8477", clock, agent_url=AGENT, job="kvctl-agent"
    )
    alerting = AlertLoop(evaluator, lambda: service.snapshots[0], lambda: service.settings)
    service.start()
    try:
        yield service, alerting, clock
    finally:
        service.stop(grace=0)


def engine_of(service: AgentService) -> Engine:
    return service.pool("demo").engine


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def fresh_snapshot(service: AgentService, clock: Clock) -> api.PoolSnapshot:
    """The first snapshot published at or after the clock's current time."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        [snapshot] = service.snapshots
        if snapshot.timestamp >= clock():
            return snapshot
        time.sleep(0.005)
    pytest.fail("the service published no snapshot for 30 s")


def run_until_idle(service: AgentService, clock: Clock) -> api.PoolSnapshot:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        clock.advance(0.1)
        snapshot = fresh_snapshot(service, clock)
        if snapshot.requests_running == 0 and snapshot.requests_waiting == 0:
            return snapshot
    pytest.fail("the requests did not finish within 60 s")


def warm(service: AgentService, clock: Clock) -> api.PoolSnapshot:
    """Finish one request, whose pages stay cached; the idle snapshot after it."""
    engine = engine_of(service)
    service.call(lambda: engine.add_request(list(range(200, 220)), greedy(4))).result(10)
    return run_until_idle(service, clock)


def queue(service: AgentService) -> None:
    for prompt in LOAD:
        service.call(lambda p=prompt: engine_of(service).add_request(p, greedy(8))).result(10)


def step_and_evaluate(
    service: AgentService, alerting: AlertLoop, clock: Clock
) -> list[tuple[api.PoolSnapshot, list[api.Alert]]]:
    """STEPS times: move agent time, take the next snapshot, evaluate alerts on it."""
    history = []
    for _ in range(STEPS):
        clock.advance(STEP_S)
        snapshot = fresh_snapshot(service, clock)
        history.append((snapshot, alerting.evaluate_once()))
    return history


def firing(alerts: list[api.Alert]) -> dict[str, api.Alert]:
    return {a.name: a for a in alerts if a.state == "firing"}


def test_a_scheduler_that_cannot_admit_raises_both_queue_alerts(stack, monkeypatch) -> None:
    service, alerting, clock = stack
    idle = warm(service, clock)
    assert idle.cached_pages > 0
    monkeypatch.setattr(Scheduler, "_admit", lambda self, ended: None)  # the old stall
    queue(service)

    history = step_and_evaluate(service, alerting, clock)

    stalled = [s.queue_stalled_seconds for s, _ in history]
    waited = [s.oldest_waiting_seconds for s, _ in history]
    assert stalled == sorted(stalled) and stalled[-1] >= (STEPS - 1) * STEP_S
    assert waited == sorted(waited) and waited[-1] >= STEPS * STEP_S
    last, alerts = history[-1]
    assert (last.requests_waiting, last.requests_running) == (len(LOAD), 0)
    assert last.cached_pages == idle.cached_pages
    # each fires at the first evaluation past its threshold, and stays
    first = {
        name: next(s for s, a in history if name in firing(a))
        for name in ("KvctlQueueStalled", "KvctlQueueWaitLong")
    }
    assert 10 < first["KvctlQueueStalled"].queue_stalled_seconds <= 10 + STEP_S
    assert 20 < first["KvctlQueueWaitLong"].oldest_waiting_seconds <= 20 + STEP_S
    now = firing(alerts)
    assert {"KvctlQueueStalled", "KvctlQueueWaitLong"} <= set(now)
    stall = now["KvctlQueueStalled"]
    assert stall.severity == "critical"
    assert stall.labels["instance"] == "node-1:8477" and stall.labels["job"] == "kvctl-agent"
    assert f"{len(LOAD)} requests have waited" in stall.description
    assert (
        f"nothing runs while {idle.cached_pages} cached prefix pages could be evicted"
        in stall.description
    )
    assert f"`kvctl --agent {AGENT} pool resize --pages 80`" in stall.remediation
    assert "KvctlAllocationFailures" not in now  # nothing was even attempted


def test_the_same_load_on_a_working_scheduler_raises_neither(stack) -> None:
    service, alerting, clock = stack
    warm(service, clock)
    queue(service)

    history = step_and_evaluate(service, alerting, clock)

    assert all(s.queue_stalled_seconds < 10 for s, _ in history)
    names = {a.name for _, alerts in history for a in alerts}
    assert not names & {"KvctlQueueStalled", "KvctlQueueWaitLong"}, names
    last, _ = history[-1]
    assert (last.requests_waiting, last.requests_running) == (0, 0)
    assert sum(last.requests_finished_total.values()) == 1 + len(LOAD)
