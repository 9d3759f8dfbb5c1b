"""The agent's core: one engine thread that owns the pool, and a thread-safe face for the server.

The engine thread is whichever thread calls `run()`; `kvctl-agent` uses its main thread.

Only the engine thread touches the engine, the pool and the storage. Everything else talks to it
in two ways: `call(fn)` queues a function to run on the engine thread between two steps (defrag,
resize, settings, new requests) and returns a future; `snapshot` is the latest immutable
`PoolSnapshot`, replaced whole after each step. So an HTTP handler never waits for more than a
queue hand-off, and the engine never waits for a handler. While the engine thread runs, the
engine-only methods (here and on the `Engine`) raise `WrongThread` for any other caller.

Between steps the thread also runs what must happen on the pool's time: automatic defrag ticks
(also when idle, which is the cheapest time to compact), automatic resize, and publishing the
snapshot with its windowed ratios.

Admission control lives here too, on the engine thread where the queue's length is exact: a
request arriving while `max_waiting` requests wait is refused (429), never queued, so a flood
costs the agent a refusal each, not memory and latency for everyone.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from kvctl.agent.alerting import AlertLoop
from kvctl.agent.autoresize import AutoResize
from kvctl.agent.config import DEFAULT_MAX_WAITING
from kvctl.agent.gpu import GpuProbe
from kvctl.agent.memory import release_free_memory
from kvctl.agent.metrics import Histograms
from kvctl.agent.pool import DefragTrigger
from kvctl.agent.pool.stats import PageStates
from kvctl.agent.runtime import Engine, Request, RequestRefused, RequestSummary, TokenEvent
from kvctl.agent.served import ServedModel
from kvctl.agent.tiers import TierStats
from kvctl.agent.window import CounterRatioWindow
from kvctl.api import (
    Alert,
    DefragResult,
    GpuMemory,
    PoolSnapshot,
    ResizeResult,
    RuntimeSettings,
    TierReading,
)
from kvctl.settings import StartupLimits, apply_changes

log = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_TICK_S = 0.05
TRIM_INTERVAL_S = 30.0
PUBLISH_INTERVAL_S = 0.1  # snapshots are at most this old (and fresh after every command)
RESIZE_CHECK_INTERVAL_S = 1.0  # automatic resize looks at windows of many seconds
DEFAULT_WINDOW_S = 300.0


class QueueFull(RequestRefused):
    """The waiting queue is at `max_waiting`: the client should retry later (429)."""

    reason = "queue_full"


class ShuttingDown(RequestRefused):
    """The agent is draining after SIGTERM and takes no new requests (503)."""

    reason = "shutting_down"


class Tally:
    """Counts by key, added to from any thread (HTTP handlers and the engine)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def read(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


@dataclass
class RequestStream:
    """Where the engine thread delivers one request's tokens: an asyncio queue on the server's
    event loop, fed thread-safely. The last event has a finish reason and the request's summary.

    `request` belongs to the engine thread; the HTTP side reads only `request_id` and the events.
    """

    request: Request
    loop: asyncio.AbstractEventLoop
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
    """Runs an `Engine` on its own thread and serves snapshots, commands and request streams."""

    def __init__(
        self,
        engine: Engine,
        pool_name: str,
        settings: RuntimeSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        gpu: GpuProbe | None = None,
        window: float = DEFAULT_WINDOW_S,
        defaults: RuntimeSettings | None = None,
        limits: StartupLimits | None = None,
        max_waiting: int = DEFAULT_MAX_WAITING,
    ) -> None:
        self.engine = engine
        self.pool_name = pool_name
        self.limits = limits or StartupLimits(
            engine.pool.segment_pages, engine.resizer.max_pages or engine.pool.capacity
        )
        self.defaults = defaults or self.limits.defaults()
        self.settings = settings or self.defaults
        self.max_waiting = max_waiting
        self.rejected = Tally()
        self.admin_actions = Tally()
        self.clock = clock
        self.wall_clock = wall_clock
        self.gpu = gpu or GpuProbe()
        self.started = clock()
        self.auto_resize = AutoResize(self.settings.resize, clock)
        self.resizes_total: Counter[str] = Counter({"grow": 0, "shrink": 0})
        self.alerting: AlertLoop | None = None  # set by the agent when it serves
        self.served = ServedModel((pool_name,), None, engine.model_config.max_context_len)
        self.histograms = Histograms()
        self.window = window
        self._alloc_window = CounterRatioWindow(window, clock)
        self._prefix_window = CounterRatioWindow(window, clock)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._grace = 10.0  # seconds running requests get to finish when stopping
        self._last_defrag: DefragResult | None = None
        self._last_defrag_at: float | None = None
        self._gpu_reading: tuple[float, list[GpuMemory]] = (float("-inf"), [])
        self._last_trim = clock()
        engine.auto_defrag.add_listener(self._note_defrag)
        self._apply_settings(self.settings)
        self.snapshot = self._build_snapshot()

    # ---- lifecycle ----------------------------------------------------------------------

    def run(self, should_stop: Callable[[], bool], grace: float | None = None) -> None:
        """Run the engine on the calling thread until `should_stop()`, then drain: refuse new
        requests, let running ones finish for up to `grace` seconds, abort the rest.

        The agent calls this on its main thread: torch runs its parallel kernels fastest from
        the thread that initialised it (the HTTP server then runs on another thread)."""
        self.engine.owner.claim()
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
            self.snapshot = self._build_snapshot()
        finally:
            self.engine.owner.release()

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
        next_publish = next_resize_check = 0.0
        while not done():
            self._run_commands()
            busy = self.engine.has_work()
            if busy:
                events = self.engine.step()
                self._dispatch(events)
                busy = bool(events)  # nothing could run: wait rather than spin
            if not busy:
                self._wake.wait(IDLE_TICK_S)
                self._wake.clear()
            if not self.engine.has_work():
                self.engine.auto_defrag.tick()
                self._trim_when_idle()
            now = self.clock()
            if now >= next_resize_check:
                self._maybe_auto_resize()
                next_resize_check = now + RESIZE_CHECK_INTERVAL_S
            if now >= next_publish:
                self.snapshot = self._build_snapshot()
                next_publish = now + PUBLISH_INTERVAL_S

    def _trim_when_idle(self) -> None:
        """Give freed heap memory back to the system, at most every `TRIM_INTERVAL_S` and only
        while idle (a trim walks malloc's arenas; idle time is when it costs nothing)."""
        now = self.clock()
        if now - self._last_trim >= TRIM_INTERVAL_S:
            self._last_trim = now
            release_free_memory()

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread between two steps; the future holds its result."""
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as error:
                future.set_exception(error)
            self.snapshot = self._build_snapshot()

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
        histograms = self.histograms
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
            self.engine.abort(request_id, "the agent shut down before the request finished")
            request = stream.request
            events.append(
                TokenEvent(request_id, None, "", request.finish_reason, RequestSummary.of(request))
            )
        self._dispatch(events)

    # ---- requests -----------------------------------------------------------------------

    def open_stream(
        self, add: Callable[[Engine], Request], loop: asyncio.AbstractEventLoop
    ) -> Future[RequestStream]:
        """Queue a request (built by `add` on the engine thread). Raises `RequestRefused` (queue
        full, shutting down, too large) or ValueError (bad input) through the future."""

        def register() -> RequestStream:
            try:
                if not self._accepting:
                    raise ShuttingDown("the agent is shutting down; send the request elsewhere")
                waiting = len(self.engine.scheduler.waiting)
                if waiting >= self.max_waiting:
                    raise QueueFull(
                        f"{waiting} requests are waiting, the most this agent queues "
                        "(--max-waiting); retry later"
                    )
                request = add(self.engine)
            except RequestRefused as refused:
                self.rejected.add(refused.reason)
                raise
            stream = RequestStream(request, loop, opened_at=self.clock())
            self._streams[request.request_id] = stream
            return stream

        return self.call(register)

    def abort(self, request_id: str) -> None:
        """Stop a request whose client went away (no-op if it already finished)."""

        def run() -> None:
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort(request_id)

        self.call(run)

    # ---- commands -----------------------------------------------------------------------

    def page_states(self) -> PageStates:
        """Run on the engine thread: a copy of every page's state, to encode elsewhere."""
        self.engine.owner.check("AgentService.page_states")
        return self.engine.pool.page_states()

    def page_states_and_snapshot(self) -> tuple[PageStates, PoolSnapshot]:
        """Run on the engine thread: the page states and a fresh snapshot of the same moment."""
        self.engine.owner.check("AgentService.page_states_and_snapshot")
        states = self.engine.pool.page_states()
        self.snapshot = self._build_snapshot()
        return states, self.snapshot

    def defrag_now(self, max_pages: int | None) -> DefragResult:
        """Run on the engine thread: a manual defragmentation, to completion or `max_pages`."""
        self.engine.owner.check("AgentService.defrag_now")
        return self.engine.auto_defrag.run_now(DefragTrigger.MANUAL, max_pages)

    def resize(self, pages: int) -> ResizeResult:
        """Run on the engine thread: resize to `pages`; `ResizeRefused` changes nothing."""
        self.engine.owner.check("AgentService.resize")
        engine = self.engine
        bytes_per_page = engine.pool.bytes_per_page
        result = engine.resizer.resize(pages)
        if result.direction != "none":
            self.resizes_total[result.direction] += 1
            log.info(
                "pool resized %s: %d -> %d pages",
                result.direction,
                result.old_pages,
                result.new_pages,
            )
        evacuation = engine.resizer.last_evacuation
        if result.direction == "shrink" and evacuation is not None and evacuation.pages_moved:
            engine.auto_defrag.record(evacuation)
        return ResizeResult(
            old_pages=result.old_pages,
            new_pages=result.new_pages,
            old_bytes=result.old_pages * bytes_per_page,
            new_bytes=result.new_pages * bytes_per_page,
            direction=result.direction,
            pages_moved=result.pages_moved,
            pages_evicted=result.pages_evicted,
        )

    def resize_tier(self, tier: str, pages: int) -> ResizeResult:
        """Run on the engine thread: give a host or disk tier room for `pages` pages (0 turns it
        off); pages evicted to fit go down a tier. ValueError when there is no such tier."""
        self.engine.owner.check("AgentService.resize_tier")
        tiers = self.engine.tiers
        if tiers is None:
            raise ValueError(
                "this agent has no tiers below the device pool (start it with "
                "--host-tier-memory or --disk-tier-path)"
            )
        held = tiers.tier(tier)
        page_bytes = held.page_bytes
        old_pages, before = held.index.capacity, held.counters.evicted_pages
        tiers.resize(tier, pages * page_bytes)
        new_pages = held.index.capacity
        direction = (
            "grow" if new_pages > old_pages else "shrink" if new_pages < old_pages else "none"
        )
        if direction != "none":
            log.info("%s tier resized %s: %d -> %d pages", tier, direction, old_pages, new_pages)
        return ResizeResult(
            old_pages=old_pages,
            new_pages=new_pages,
            old_bytes=old_pages * page_bytes,
            new_bytes=new_pages * page_bytes,
            direction=direction,
            pages_moved=0,
            pages_evicted=held.counters.evicted_pages - before,
            tier=tier,
        )

    def change_settings(self, changes: object) -> tuple[RuntimeSettings, RuntimeSettings]:
        """Run on the engine thread: merge a PATCH body into the settings in force and apply
        them; returns the settings before and after. Merging here, not on the HTTP thread,
        makes concurrent changes serial; a refused change (`SettingsError`) changes nothing."""
        self.engine.owner.check("AgentService.change_settings")
        before = self.settings
        settings = apply_changes(before, changes, self.defaults, self.limits)
        self._apply_settings(settings)
        return before, settings

    def _apply_settings(self, settings: RuntimeSettings) -> None:
        self.settings = settings
        self.engine.auto_defrag.policy = settings.defrag
        self.auto_resize.update_settings(settings.resize)
        resizer = self.engine.resizer
        resizer.max_pages = settings.resize.max_pages or self.limits.max_pool_pages
        resizer.min_pages = settings.resize.min_pages or self.limits.segment_pages
        if self.engine.config.prefix_cache:
            self.engine.set_eviction_policy(settings.prefix_cache.eviction_policy)
        self.engine.scheduler.tier_min_load_tokens = settings.prefix_cache.tier_min_load_tokens
        tiers = self.engine.tiers
        if tiers is not None:
            for tier in tiers.tiers:
                tiers.set_policy(
                    tier.name, getattr(settings.prefix_cache, f"{tier.name}_tier_policy")
                )

    def _maybe_auto_resize(self) -> None:
        stats = self.engine.pool.stats()
        target = self.auto_resize.decide(
            stats, self._spare_device_bytes(), self.engine.pages_promised()
        )
        if target is None or target == stats.capacity_pages:
            return
        try:
            self.resize(target)
        except Exception as error:  # a refused automatic resize is logged, never fatal
            log.warning("automatic resize to %d pages refused: %s", target, error)

    def _spare_device_bytes(self) -> int | None:
        device = self.engine.device
        if device.type != "cuda":
            return None
        return self.gpu.free_bytes(device.index or 0)

    def _note_defrag(self, report: DefragResult) -> None:
        self.histograms.defrag.observe(report.seconds)
        self._last_defrag, self._last_defrag_at = report, self.clock()

    # ---- the snapshot -------------------------------------------------------------------

    def _build_snapshot(self) -> PoolSnapshot:
        engine = self.engine
        stats = engine.stats
        pool = engine.pool.stats()
        self._alloc_window.record(
            pool.alloc_attempts_total - pool.alloc_failures_total, pool.alloc_attempts_total
        )
        successes, attempts = self._alloc_window.increases()
        now = self.clock()
        oldest = stats.oldest_queued_at
        waited = 0.0 if oldest is None else max(0.0, now - oldest)
        stalled = 0.0 if oldest is None else max(0.0, now - max(oldest, stats.last_progress_at))
        self._prefix_window.record(stats.prefix_hits_tokens, stats.prefix_queries_tokens)
        auto = engine.auto_defrag
        last_age = None if self._last_defrag_at is None else self.clock() - self._last_defrag_at
        runs = {trigger.value: auto.runs_total[trigger] for trigger in DefragTrigger}
        return PoolSnapshot(
            **dict(pool),  # the pool's own reading: pages, runs, allocation counters
            pool=self.pool_name,
            timestamp=self.wall_clock(),
            device=str(engine.device),
            prompt_tokens_total=stats.prompt_tokens,
            generation_tokens_total=stats.generated_tokens,
            max_pool_pages=engine.resizer.max_pages,
            alloc_success_ratio=self._alloc_window.ratio(),
            window_seconds=self.window,
            prefix_cache_enabled=engine.config.prefix_cache,
            prefix_queries_tokens_total=stats.prefix_queries_tokens,
            prefix_hits_tokens_total=stats.prefix_hits_tokens,
            prefix_hit_ratio=self._prefix_window.ratio(),
            prefix_evictions_total=sum(stats.prefix_evictions.values()),
            prefix_hits_tokens_by_tier=stats.prefix_hits_by_tier,
            tiers=[tier_reading(t) for t in stats.tiers],
            prefill_seconds_per_token=stats.prefill_seconds_per_token,
            defrag_runs_total=runs,
            defrag_pages_moved_total=auto.pages_moved_total,
            defrag_active=auto.active is not None,
            last_defrag=self._last_defrag,
            last_defrag_age_seconds=last_age,
            auto_defrag_enabled=auto.policy.enabled,
            resizes_total=dict(self.resizes_total),
            requests_running=stats.requests_running,
            requests_waiting=stats.requests_waiting,
            preemptions_total=stats.preemptions,
            alert_notifications_dropped_total=self.alerting.dropped_total if self.alerting else 0,
            gpus=self._gpus(),
            max_waiting=self.max_waiting,
            oldest_waiting_seconds=waited,
            queue_stalled_seconds=stalled,
            window_alloc_attempts=attempts,
            window_alloc_failures=attempts - successes,
            requests_finished_total=dict(stats.finished),
            requests_rejected_total=self.rejected.read(),
            admin_actions_total=self.admin_actions.read(),
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


def tier_reading(stats: TierStats) -> TierReading:
    """The API's reading of one tier."""
    counters = stats.counters
    free, size = stats.filesystem if stats.filesystem is not None else (None, None)
    return TierReading(
        tier=stats.name,
        policy=stats.policy,
        capacity_pages=stats.capacity_pages,
        used_pages=stats.used_pages,
        page_bytes=stats.page_bytes,
        hits_tokens_total=counters.hits_tokens,
        stored_pages_total=counters.stored_pages,
        stored_bytes_total=counters.stored_bytes,
        loaded_pages_total=counters.loaded_pages,
        loaded_bytes_total=counters.loaded_bytes,
        store_seconds_total=counters.store_seconds,
        load_seconds_total=counters.load_seconds,
        evicted_pages_total=counters.evicted_pages,
        store_failures_total=dict(counters.store_failures),
        load_failures_total=dict(counters.load_failures),
        path=stats.path,
        filesystem_free_bytes=free,
        filesystem_size_bytes=size,
    )
