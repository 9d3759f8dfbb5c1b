"""The agent's core: one engine thread that owns the pools, and a thread-safe face for the server.

The engine thread is whichever thread calls `run()`; `kvctl-agent` uses its main thread.

An agent serves one model or several (`ModelPool` each: an engine with its pool, scheduler,
prefix cache and tiers). Only the engine thread touches them. It steps every engine that has
work in turn, so the models share the device the way they share the KV budget: one step at a
time. Everything else talks to it in two ways: `call(fn)` queues a function to run on the engine
thread between two steps (a pool's action, settings, new requests) and returns a future; each
pool's `snapshot` is the latest immutable `PoolSnapshot`, replaced whole after each step. So an
HTTP handler never waits for more than a queue hand-off, and the engine never waits for a
handler. While the engine thread runs, the engine-only methods (`engine_only` here, on
`ModelPool` and `PrefixAdmin`; the `Engine`'s own) raise `WrongThread` for any other caller.

What is the service's and what is a pool's: the service owns what concerns the agent as a whole
(the set of pools and finding one by name, the engine thread and running work on it, admission
and the queues across models, the shared budget and its rebalancing, the settings in force,
shutdown) and the rules that weigh one model against the others: the last awake model sleeps
only when forced, and a wake takes back room from the other pools. Every action and reading of
one model's pool is the `ModelPool`'s (defrag, resize, tier resize, release, the page map, the
snapshot, the model's own sleeping and waking): a route finds the pool with `pool(name)` and runs
its action through `call`, so nothing here forwards a pool's action.

Between steps the thread also runs what must happen on the pools' time: automatic defrag ticks
(also when idle, which is the cheapest time to compact), automatic resize, rebalancing memory
between the pools of one budget, and publishing the snapshots with their windowed ratios.

Admission control lives here too, on the engine thread where each queue's length is exact: a
request arriving while `max_waiting` requests wait for its model is refused (429), never queued,
so a flood costs the agent a refusal each, not memory and latency for everyone.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from kvctl.agent.budget import KvBudget, Rebalancer
from kvctl.agent.memory import IdleTrim, release_free_memory
from kvctl.agent.model_pool import AgentReadings, ModelPool
from kvctl.agent.model_sleep import MakeRoom, SleepRefused
from kvctl.agent.observe.alerting import AlertLoop
from kvctl.agent.observe.gpu import GpuProbe
from kvctl.agent.observe.metrics import KvEventCounters
from kvctl.agent.observe.tally import Tally
from kvctl.agent.prefix_admin import PrefixAdmin
from kvctl.agent.runtime import Engine, Request, RequestRefused, RequestSummary, TokenEvent
from kvctl.agent.runtime.thread_owner import ThreadOwner, engine_only
from kvctl.api import (
    Alert,
    GpuMemory,
    PoolShare,
    PoolSnapshot,
    RuntimeSettings,
    SleepLevel,
    SleepResult,
    SleepTrigger,
    WakeResult,
    WakeTrigger,
)
from kvctl.settings import StartupLimits, apply_changes

log = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_TICK_S = 0.05
# An idle engine that gets a request waits for the rest of its burst (clients that run N streams
# send N requests together when a wave ends): up to ARRIVAL_WINDOW_S, while the next arrives
# within ARRIVAL_GAP_S. One step then computes the whole wave instead of one prompt, then the rest.
# When N requests ended since the engine was last idle, up to N replacements are waited for
# with the longer REFILL_GAP_S (up to REFILL_WINDOW_S): a closed-loop client sends them a few
# milliseconds apart, and a wave split at 3 ms cost its later prompts a whole step of TTFT.
ARRIVAL_GAP_S = 0.003
ARRIVAL_WINDOW_S = 0.015
REFILL_GAP_S = 0.010
REFILL_WINDOW_S = 0.050
PUBLISH_INTERVAL_S = 0.1  # snapshots are at most this old (and fresh after every command)
RESIZE_CHECK_INTERVAL_S = 1.0  # automatic resize looks at windows of many seconds
REBALANCE_CHECK_INTERVAL_S = 0.5  # pressure is read this often; moves need it to hold longer
IDLE_SLEEP_CHECK_INTERVAL_S = 1.0  # sleep.idle_s is at least a second
WAKE_SETTLE_S = 60.0  # at shutdown, the longest wait for a checkpoint being reloaded


class UnknownPool(LookupError):
    """A pool (model) this agent does not serve; the message names the ones it does."""


class QueueFull(RequestRefused):
    """The waiting queue is at `max_waiting`: the client should retry later (429)."""

    reason = "queue_full"


def queue_full(waiting: int, target: ModelPool) -> QueueFull:
    return QueueFull(
        f"{waiting} requests are waiting, the most this agent queues for model "
        f"{target.name!r} (--max-waiting); retry later"
    )


class WakeFailed(RequestRefused):
    """The request's model sleeps and could not wake (503); the message says why."""

    reason = "wake_failed"


class ShuttingDown(RequestRefused):
    """The agent is draining after SIGTERM and takes no new requests (503)."""

    reason = "shutting_down"


@dataclass
class RequestStream:
    """Where the engine thread delivers one request's tokens: an asyncio queue on the server's
    event loop, fed thread-safely. The last event has a finish reason and the request's summary.

    `request` belongs to the engine thread; the HTTP side reads only `request_id` and the events.
    """

    request: Request
    loop: asyncio.AbstractEventLoop
    pool: ModelPool
    events: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    opened_at: float = 0.0  # the service's clock, when the request was accepted
    last_token_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id  # set once at creation: safe from any thread


def _deliver_all(deliveries: list[tuple[RequestStream, TokenEvent]]) -> None:
    for stream, event in deliveries:
        stream.events.put_nowait(event)


class AgentService:
    """Runs the engines of one or several `ModelPool`s on one thread and serves snapshots,
    commands and request streams.

    Built from its pools, in the order the models were configured; `share_budget` puts them
    all under one KV budget, before `run()` or `start()`. The settings are checked against
    `limits`, by default the first pool's (each pool keeps its own for its resizer). `pool(name)`
    finds a pool by a name it is served under (None: the only pool)."""

    def __init__(
        self,
        pools: Sequence[ModelPool],
        settings: RuntimeSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        gpu: GpuProbe | None = None,
        defaults: RuntimeSettings | None = None,
        limits: StartupLimits | None = None,
    ) -> None:
        if not pools:
            raise ValueError("an agent serves at least one model")
        self.limits = limits or pools[0].limits
        self.defaults = defaults or self.limits.defaults()
        self.settings = settings or self.defaults
        self.admin_actions = Tally()
        self.clock = clock
        self.gpu = gpu or GpuProbe()
        self.started = clock()
        self.alerting: AlertLoop | None = None  # set by the agent when it serves
        self.kv_events: KvEventCounters | None = None  # set when it publishes KV events
        self.pools: dict[str, ModelPool] = {}
        self.budget: KvBudget | None = None
        self.rebalancer: Rebalancer | None = None
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        # requests handed to the engine thread and not yet queued there, by pool
        self._opening: Counter[str] = Counter()
        self._opening_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._grace = 10.0  # seconds running requests get to finish when stopping
        self._gpu_reading: tuple[float, list[GpuMemory]] = (float("-inf"), [])
        # (requests waiting once the last wave is replaced, until when to wait for them)
        self._refill: tuple[int, float] | None = None
        self._ended = 0  # requests ended since the engines were last idle
        self._idle_trim = IdleTrim(clock())  # returns a burst's freed heap (kvctl.agent.memory)
        self.owner = ThreadOwner()  # claimed by the engine thread with the engines'
        self.prefix = PrefixAdmin(self.pools, self.pool, self.owner)  # lookups, pins and clears
        for pool in pools:
            if pool.name in self.pools:
                raise ValueError(f"two models are named {pool.name!r}")
            self.pools[pool.name] = pool
            pool.sleep.notify = self._wake.set  # a loader thread's weights are ready
            pool.agent_readings = functools.partial(self._readings, pool)
            pool.apply_settings(self.settings)
            pool.publish()

    def share_budget(self, budget: KvBudget) -> None:
        """Put every pool under `budget` (whose members are the pools' resizers, by name) and
        start moving memory between them."""
        for name, pool in self.pools.items():
            pool.budget = budget
            member = budget.pools[name]
            member.on_resize = pool.record_resize
            member.make_room = pool.engine.scheduler.preempt_to_fit
            pool.engine.scheduler.reachable_pages = lambda n=name: budget.reachable_pages(n)
        self.budget = budget
        self.rebalancer = Rebalancer(budget, self.settings.rebalance, self.clock)
        self._publish_all()

    # ---- the pools ----------------------------------------------------------------------

    @property
    def snapshots(self) -> list[PoolSnapshot]:
        """The latest snapshot of every pool, in the order the models were configured."""
        return [pool.snapshot for pool in self.pools.values() if pool.snapshot is not None]

    def pool(self, name: str | None) -> ModelPool:
        """The pool of model `name` (a served name or alias; None: the only pool). Raises
        `UnknownPool` naming the pools served."""
        if name is None:
            if len(self.pools) == 1:
                return next(iter(self.pools.values()))
            raise UnknownPool(f"this agent serves several models ({self.names()})")
        if name in self.pools:
            return self.pools[name]
        for pool in self.pools.values():
            if name in pool.served.names:
                return pool
        raise UnknownPool(f"model {name!r} is not served here; this agent serves {self.names()}")

    def names(self) -> str:
        return ", ".join(repr(name) for pool in self.pools.values() for name in pool.served.names)

    # ---- lifecycle ----------------------------------------------------------------------

    def run(self, should_stop: Callable[[], bool], grace: float | None = None) -> None:
        """Run the engines on the calling thread until `should_stop()`, then drain: refuse new
        requests, let running ones finish for up to `grace` seconds, abort the rest.

        The agent calls this on its main thread: torch runs its parallel kernels fastest from
        the thread that initialised it (the HTTP server then runs on another thread)."""
        owners = [self.owner, *(pool.engine.owner for pool in self.pools.values())]
        for owner in owners:
            owner.claim()
        try:
            if self.alerting is not None:
                self.alerting.start()
            self._loop(should_stop)
            self._accepting = False
            if self.alerting is not None:
                self.alerting.stop()
            deadline = self.clock() + (self._grace if grace is None else grace)
            self._loop(lambda: not self._streams or self.clock() >= deadline)
            self._abort_all()
            self._publish_all()
            for pool in self.pools.values():
                pool.sleep.settle(WAKE_SETTLE_S)
        finally:
            for owner in owners:
                owner.release()

    def start(self) -> None:
        """Run the engine on a thread of its own (for tests and in-process embedding)."""
        self._thread = threading.Thread(
            target=self.run, args=(self._stopping.is_set,), name="kvctl-engine", daemon=True
        )
        self._thread.start()

    def stop(self, grace: float = 10.0) -> None:
        """End a `start()`ed engine thread: drain for up to `grace` seconds, then stop."""
        if self._thread is None:
            return
        self._grace = grace
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=grace + 10)

    @property
    def alerts(self) -> list[Alert]:
        """The latest evaluation: pending and firing alerts, most severe first."""
        return self.alerting.alerts if self.alerting is not None else []

    @property
    def accepting(self) -> bool:
        return self._accepting

    # ---- the engine thread --------------------------------------------------------------

    def _loop(self, done: Callable[[], bool]) -> None:
        next_publish = next_resize_check = next_rebalance = next_idle_check = 0.0
        pools = list(self.pools.values())
        while not done():
            self._run_commands()
            self._finish_wakes(pools)
            awake = [pool for pool in pools if pool.sleep.awake]
            self._gather_arrivals(awake)
            busy = self._step_all(awake)
            if not busy:
                self._wake.wait(IDLE_TICK_S)
                self._wake.clear()
            idle = True
            for pool in awake:
                if not pool.engine.has_work():
                    pool.engine.auto_defrag.tick()
                else:
                    idle = False
            if self._idle_trim.tick(self.clock(), busy=not idle):
                release_free_memory()  # a trim walks malloc's arenas: idle time costs nothing
            now = self.clock()
            if now >= next_rebalance:
                self._rebalance()
                next_rebalance = now + REBALANCE_CHECK_INTERVAL_S
            if now >= next_resize_check:
                for pool in pools:
                    pool.maybe_auto_resize(self._spare_device_bytes(pool.engine))
                next_resize_check = now + RESIZE_CHECK_INTERVAL_S
            if now >= next_idle_check:
                self._sleep_idle(now)
                next_idle_check = now + IDLE_SLEEP_CHECK_INTERVAL_S
            if now >= next_publish:
                self.prefix.expire()
                self._publish_all()
                next_publish = now + PUBLISH_INTERVAL_S

    def _step_all(self, pools: list[ModelPool]) -> bool:
        """One step of every pool with work; False when none produced anything (nothing could
        run: the loop waits rather than spins). A step that leaves every engine empty notes
        the wave that ended since the engines were last idle (a request a step ahead of the
        others belongs to it too), for `_gather_arrivals`."""
        busy, ended = False, 0
        for pool in pools:
            if pool.engine.has_work():
                pool.sleep.last_active = self.clock()
                events = pool.engine.step()
                self._dispatch(events)
                busy = busy or bool(events)
                ended += sum(e.finish_reason is not None for e in events)
        self._ended += ended
        if ended and not any(pool.engine.scheduler.running for pool in pools):
            waiting = sum(len(pool.engine.scheduler.waiting) for pool in pools)
            self._refill = (waiting + self._ended, time.monotonic() + REFILL_WINDOW_S)
        return busy

    def _gather_arrivals(self, pools: list[ModelPool]) -> None:
        """When requests wait and none runs, take the rest of their burst before the first step
        (see ARRIVAL_WINDOW_S and REFILL_WINDOW_S); a lone request pays ARRIVAL_GAP_S of TTFT."""
        engines = [pool.engine for pool in pools]
        if any(e.scheduler.running for e in engines) or not any(e.has_work() for e in engines):
            return
        (refill, refill_until), self._refill = self._refill or (0, 0.0), None
        self._ended = 0  # the engines go from idle to busy: a new wave starts
        deadline = time.monotonic() + ARRIVAL_WINDOW_S  # real time even under a test's clock
        while True:
            waiting = sum(len(e.scheduler.waiting) for e in engines)
            if refill and waiting >= refill:
                return  # the wave is whole
            short = waiting < refill
            gap = REFILL_GAP_S if short else ARRIVAL_GAP_S
            if time.monotonic() >= (refill_until if short else deadline):
                return
            self._wake.clear()
            if not self._wake.wait(gap):
                return
            self._run_commands()

    def _rebalance(self) -> None:
        """Read every pool's pressure and let the rebalancer move memory to those short of
        it (each resize it makes is recorded through the pool's `on_resize`)."""
        rebalancer = self.rebalancer
        if rebalancer is None:
            return
        pools = self.pools.values()
        rebalancer.observe({p.name: (p.pressure(), p.engine.pages_promised()) for p in pools})
        for move in rebalancer.rebalance():
            donors = ", ".join(f"{name} {n:,} bytes" for name, n in move.given.items())
            log.info(
                "rebalance: pool %s took %s bytes (from %s)",
                move.taker,
                f"{move.taken_bytes:,}",
                donors or "the unassigned budget",
            )

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread between two steps; the future holds its result. The
        snapshots are published before the future is done, so a caller's next read sees what
        `fn` did."""
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn()
            except BaseException as error:
                self._publish_all()
                future.set_exception(error)
                return
            self._publish_all()
            future.set_result(result)

        self._commands.put(run)
        self._wake.set()
        return future

    def _dispatch(self, events: list[TokenEvent]) -> None:
        """Hand a step's events to their streams with one wake-up of the server's loop (every
        stream lives on that one loop)."""
        deliveries: list[tuple[RequestStream, TokenEvent]] = []
        now = self.clock()
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is None:
                continue
            deliveries.append((stream, event))
            self._time(stream, event, now)
            if event.finish_reason is not None:
                del self._streams[event.request_id]
        if deliveries:
            deliveries[0][0].loop.call_soon_threadsafe(_deliver_all, deliveries)

    def _time(self, stream: RequestStream, event: TokenEvent, now: float) -> None:
        """The request's latencies, as its events go out (engine thread)."""
        histograms = stream.pool.histograms
        if event.token_id is not None:
            if stream.last_token_at is None:
                histograms.time_to_first_token.observe(max(0.0, now - stream.opened_at))
            else:
                histograms.inter_token.observe(max(0.0, now - stream.last_token_at))
            stream.last_token_at = now
        if event.finish_reason is not None:
            histograms.request.observe(max(0.0, now - stream.opened_at))
            request = stream.request
            if request.first_admitted_at is not None:
                histograms.queue.observe(max(0.0, request.first_admitted_at - request.arrived_at))

    def _abort_all(self) -> None:
        events = []
        for request_id, stream in list(self._streams.items()):
            stream.pool.engine.abort(request_id, "the agent shut down before the request finished")
            request = stream.request
            events.append(
                TokenEvent(request_id, None, "", request.finish_reason, RequestSummary.of(request))
            )
        self._dispatch(events)

    # ---- requests -----------------------------------------------------------------------

    def open_stream(
        self,
        add: Callable[[Engine], Request],
        loop: asyncio.AbstractEventLoop,
        target: ModelPool,
    ) -> Future[RequestStream]:
        """Queue a request for `target`, built by `add` on the engine thread. Raises
        `RequestRefused` (queue full, shutting down, too large) or ValueError (bad input)
        through the future."""
        refused = self._refuse_when_full(target)
        if refused is not None:
            return refused

        def register() -> RequestStream:
            try:
                if not self._accepting:
                    raise ShuttingDown("the agent is shutting down; send the request elsewhere")
                waiting = len(target.engine.scheduler.waiting)
                if waiting >= target.max_waiting:
                    raise queue_full(waiting, target)
                if not target.sleep.awake:
                    woken = self.wake(target, "request")
                    if woken.done() and woken.exception() is not None:
                        raise WakeFailed(str(woken.exception()))
                target.sleep.last_active = self.clock()
                request = add(target.engine)
            except RequestRefused as refused:
                target.rejected.add(refused.reason)
                raise
            stream = RequestStream(request, loop, target, opened_at=self.clock())
            self._streams[request.request_id] = stream
            return stream

        future = self.call(register)
        future.add_done_callback(lambda _: self._opened(target))  # also when cancelled
        return future

    def _opened(self, target: ModelPool) -> None:
        with self._opening_lock:
            self._opening[target.name] -= 1

    def _refuse_when_full(self, target: ModelPool) -> Future[RequestStream] | None:
        """A 429 answered on the server's thread when the queue, counting the requests already
        on their way to it, is full: a flood is refused as it arrives, not at the end of the
        engine's step in progress (up to a 2,048-token step later), and the engine thread does
        not spend its time between steps refusing."""
        with self._opening_lock:
            waiting = len(target.engine.scheduler.waiting) + self._opening[target.name]
            if waiting < target.max_waiting:
                self._opening[target.name] += 1
                return None
        target.rejected.add(QueueFull.reason)
        future: Future[RequestStream] = Future()
        future.set_exception(queue_full(waiting, target))
        return future

    def abort(self, request_id: str) -> None:
        """Stop a request whose client went away (no-op if it already finished)."""

        def run() -> None:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.pool.engine.abort(request_id)

        self.call(run)

    # ---- the agent-wide commands (engine thread) ----------------------------------------

    @engine_only
    def sleep(
        self,
        pool: ModelPool,
        level: SleepLevel,
        force: bool = False,
        trigger: SleepTrigger = "manual",
    ) -> SleepResult:
        """Put a model to sleep (`kvctl.agent.model_sleep`); `SleepRefused` changes nothing.
        The service's because the last awake model sleeps only when forced: every request
        would then wait for a wake."""
        pool.sleep.check_can_sleep(level)
        if not force and self._awake_count() == 1:
            raise SleepRefused(
                f"model {pool.name!r} is the last awake model of this agent: asleep, every "
                "request would wait for it to wake; force it (kvctl sleep --force) to sleep "
                "it anyway"
            )
        result = pool.sleep.sleep(level, trigger, pool.member)
        pool.publish()
        return result

    @engine_only
    def wake(self, pool: ModelPool, trigger: WakeTrigger = "manual") -> Future[WakeResult]:
        """Start waking a model; the future is done when it can step, with `SleepRefused` when
        the wake failed. The service's because the pool takes back room from the others."""
        return pool.sleep.wake(trigger, pool.member, self._make_room(pool))

    def _make_room(self, pool: ModelPool) -> MakeRoom | None:
        rebalancer = self.rebalancer
        if rebalancer is None or pool.member is None:
            return None
        return lambda wanted: rebalancer.make_room(pool.name, wanted)

    def _finish_wakes(self, pools: list[ModelPool]) -> None:
        """Serve the models whose weights have loaded; a failed wake ends the requests that
        waited for it."""
        for pool in pools:
            if not pool.sleep.waking:
                continue
            failure = pool.sleep.poll(pool.member)
            if failure is not None:
                self._end_waiting(pool, failure)
            pool.publish()

    def _end_waiting(self, pool: ModelPool, detail: str) -> None:
        events = []
        for request in list(pool.engine.scheduler.waiting):
            pool.engine.abort(request.request_id, detail)
            events.append(
                TokenEvent(
                    request.request_id,
                    None,
                    "",
                    request.finish_reason,
                    RequestSummary.of(request),
                )
            )
        self._dispatch(events)

    def _awake_count(self) -> int:
        return sum(pool.sleep.awake or pool.sleep.waking for pool in self.pools.values())

    def _sleep_idle(self, now: float) -> None:
        """Put to sleep the models idle for `sleep.idle_s` (never the last awake one)."""
        idle_s = self.settings.sleep.idle_s
        if idle_s is None:
            return
        level: SleepLevel = 2 if self.settings.sleep.level == 2 else 1
        for pool in self.pools.values():
            if not pool.sleep.awake or pool.engine.has_work():
                continue
            if now - pool.sleep.last_active < idle_s or self._awake_count() <= 1:
                continue
            try:
                self.sleep(pool, level, trigger="idle")
            except SleepRefused as refused:  # pins, say: it stays awake, and says why
                log.debug("model %s stays awake: %s", pool.name, refused)
                pool.sleep.last_active = now  # asked again after another idle period

    @engine_only
    def change_settings(self, changes: object) -> tuple[RuntimeSettings, RuntimeSettings]:
        """Merge a PATCH body into the settings in force and apply them to every pool; returns
        the settings before and after. Merging on the engine thread, not on the HTTP thread,
        makes concurrent changes serial; a refused change (`SettingsError`) changes nothing."""
        before = self.settings
        settings = apply_changes(before, changes, self.defaults, self.limits)
        self.settings = settings
        for pool in self.pools.values():
            pool.apply_settings(settings)
        if self.rebalancer is not None:
            self.rebalancer.settings = settings.rebalance
        return before, settings

    def _spare_device_bytes(self, engine: Engine) -> int | None:
        device = engine.device
        if device.type != "cuda":
            return None
        return self.gpu.free_bytes(device.index or 0)

    # ---- the snapshots ------------------------------------------------------------------

    def _publish_all(self) -> None:
        for pool in self.pools.values():
            pool.publish()

    def _readings(self, pool: ModelPool) -> AgentReadings:
        """What `pool`'s snapshot carries about the agent as a whole (its `agent_readings`)."""
        return AgentReadings(
            alert_notifications_dropped_total=self.alerting.dropped_total if self.alerting else 0,
            admin_actions_total=self.admin_actions.read(),
            gpus=self._gpus(),
            share=self._share(pool),
        )

    def _share(self, pool: ModelPool) -> PoolShare | None:
        """Where `pool` stands in the budget, as the rebalancer saw it at its last check."""
        budget, rebalancer, member = self.budget, self.rebalancer, pool.member
        if budget is None or rebalancer is None or member is None:
            return None
        seen = rebalancer.history[pool.name]
        history = rebalancer.history.values()
        return PoolShare(
            budget_bytes=budget.total_bytes,
            assigned_bytes=budget.assigned_bytes,
            floor_pages=member.floor_pages,
            ceiling_pages=member.ceiling_pages,
            share_pages=member.share_pages,
            pinned=member.pinned,
            under_pressure=seen.pressure.any,
            short_pages=seen.pressure.short_pages,
            reclaimable_pages=seen.reclaimable_pages,
            pools_total=len(budget.pools),
            pools_under_pressure=sum(h.pressure.any for h in history),
            donors=sum(h.donor for h in history),
            rebalances_total={"in": seen.moves["in"], "out": seen.moves["out"]},
            rebalanced_bytes_total={"in": seen.moved_bytes["in"], "out": seen.moved_bytes["out"]},
        )

    def _gpus(self) -> list[GpuMemory]:
        """NVML readings, at most one per second (snapshots are built after every step)."""
        if not self.gpu.available:
            return []
        taken, gpus = self._gpu_reading
        now = self.clock()
        if now - taken >= 1.0:
            gpus = self.gpu.read()
            self._gpu_reading = (now, gpus)
        return gpus

    def uptime(self) -> float:
        return self.clock() - self.started
