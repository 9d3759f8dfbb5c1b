"""Putting one served model to sleep and waking it again (`kvctl sleep`, `kvctl wake`).

An idle model still holds its KV pool and its weights. Asleep, it holds no KV memory: its cached
prefixes are evicted (down a tier, where a tier's policy keeps them), its pool shrinks to one
segment and the storage frees that one too (`KVStorage.park`); under a shared budget it counts
for nothing and has no floor, so the other pools may grow into its memory, and its share stays
its own, lent meanwhile. Level 1 keeps the weights in host memory (moved there from a GPU; on the
CPU they are there already and stay); level 2 drops them, and a wake loads the checkpoint again.

A wake (`kvctl wake`, or a request for the sleeping model) brings the pool back at once on the
engine thread, as large as it was, taking back from the other pools what they borrowed of its
share (`Rebalancer.make_room`); then the weights: moved back to the device, or reloaded on a
thread of its own so that the other models keep serving meanwhile. Requests wait in the model's
queue until it can step; the wake's duration, from the wake to the moment it can step, is
observed in `kvctl_model_wake_seconds`.

Refused, changing nothing: a model with requests running or waiting (they would lose their
pages), one with pinned prefixes (a pin promises its pages stay on the device), a model already
asleep, and level 2 where nothing can reload the weights. The agent's last awake model is the
service's rule (`AgentService.sleep`), and so is the room a wake takes back from the other pools
(`AgentService.wake`): a sleep or wake reaches this model's part through them, and they check
their caller.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING

import torch

from kvctl.agent.memory import release_free_memory
from kvctl.agent.pool import ResizeRefused
from kvctl.api import (
    SleepLevel,
    SleepReading,
    SleepResult,
    SleepStateName,
    SleepTrigger,
    WakeResult,
    WakeTrigger,
)

if TYPE_CHECKING:
    from kvctl.agent.budget import BudgetedPool
    from kvctl.agent.model import LlamaModel
    from kvctl.agent.observe.metrics import DurationHistogram
    from kvctl.agent.runtime import Engine

log = logging.getLogger(__name__)

Reload = Callable[[], "LlamaModel"]
"""Loads the model's checkpoint again, as the agent loaded it at start (run on a worker
thread)."""

MakeRoom = Callable[[int], int]
"""Frees up to the given bytes of the shared budget for a waking pool; the bytes unassigned
then."""


class SleepRefused(ValueError):
    """A sleep or wake that cannot be carried out now; the message says why and what to do.
    Nothing changed."""


class ModelSleep:
    """Whether one model sleeps, and the sleeping and waking of it (engine thread)."""

    def __init__(
        self,
        engine: Engine,
        name: str,
        wake_histogram: DurationHistogram,
        reload: Reload | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.name = name
        self.reload = reload
        self.wake_histogram = wake_histogram
        self.clock = clock
        self.notify: Callable[[], None] | None = None  # wakes the engine loop when weights load
        self.level: SleepLevel | None = None  # None: awake
        self.asleep_since: float | None = None
        self.last_active = clock()  # the last time the model had work (for sleep.idle_s)
        self.sleeps_total: Counter[str] = Counter({"manual": 0, "idle": 0})
        self.wakes_total: Counter[str] = Counter({"manual": 0, "request": 0})
        self.last_wake_seconds: float | None = None
        self.last_wake_error: str | None = None
        self._pages = 0  # the pool's capacity when it fell asleep
        self._kv_bytes = 0
        self._weights_bytes = 0
        self._weights_on_device = False  # whether the weights sleep moved were device memory
        self._wake_started: float | None = None
        self._wake_trigger: WakeTrigger = "manual"
        self._loading: Future[LlamaModel] | None = None
        self._waiters: list[Future[WakeResult]] = []

    # ---- state --------------------------------------------------------------------------

    @property
    def awake(self) -> bool:
        return self.level is None

    @property
    def waking(self) -> bool:
        return self._wake_started is not None

    @property
    def holds_no_pages(self) -> bool:
        """Asleep with its storage freed (a wake under way may not have brought it back yet)."""
        return not self.awake and self.engine.storage.parked > 0

    def reading(self) -> SleepReading:
        """The snapshot's view of it."""
        state: SleepStateName = "awake" if self.awake else "waking" if self.waking else "asleep"
        since = self.asleep_since
        on_device = self._weights_bytes if self._weights_on_device else 0
        return SleepReading(
            state=state,
            level=self.level,
            asleep_seconds=None if since is None else max(0.0, self.clock() - since),
            released_bytes=0 if self.awake else self._kv_bytes + on_device,
            weights_released_bytes=0 if self.awake else self._weights_bytes,
            sleeps_total=dict(self.sleeps_total),
            wakes_total=dict(self.wakes_total),
            last_wake_seconds=self.last_wake_seconds,
            last_wake_error=self.last_wake_error,
        )

    # ---- sleeping -----------------------------------------------------------------------

    def check_can_sleep(self, level: SleepLevel) -> None:
        """Raise `SleepRefused` unless the model could sleep at `level` now."""
        name, scheduler = self.name, self.engine.scheduler
        if not self.awake:
            raise SleepRefused(
                f"model {name!r} is already asleep at level {self.level}; "
                f"kvctl wake --model {name} first to sleep it at another level"
            )
        if level == 2 and self.reload is None:
            raise SleepRefused(
                f"model {name!r} has no checkpoint to reload its weights from; sleep it at level 1"
            )
        running, waiting = len(scheduler.running), len(scheduler.waiting)
        if running or waiting or self.engine.has_work():
            raise SleepRefused(
                f"model {name!r} has {running} requests running and {waiting} waiting, which "
                "would lose their pages; stop its traffic or wait until it is idle"
            )
        pins = scheduler.pins
        if len(pins):
            raise SleepRefused(
                f"model {name!r} has {len(pins)} pinned prefixes holding {pins.pinned_pages} "
                "pages on the device; unpin them first (kvctl prefix ls; kvctl prefix unpin)"
            )

    def sleep(
        self, level: SleepLevel, trigger: SleepTrigger, member: BudgetedPool | None
    ) -> SleepResult:
        """Release the pool (and at level 2 the weights); `SleepRefused` changes nothing."""
        engine = self.engine
        self.check_can_sleep(level)
        pool = engine.pool
        evicted = pool.evict(pool.cached_pages, "sleep") if pool.cached_pages else 0
        self._pages = pool.capacity
        self._kv_bytes = pool.capacity * pool.bytes_per_page
        self._park(member)
        device = engine.device
        self._weights_on_device = device.type != "cpu"
        if level == 1:
            self._weights_bytes = engine.weights_bytes(device) if self._weights_on_device else 0
            if self._weights_on_device:
                engine.move_weights(torch.device("cpu"))
                _release_device_cache(device)
        else:
            self._weights_bytes = engine.weights_bytes()
            engine.unload_weights()
            gc.collect()  # the modules refer to each other: free the tensors now
            _release_device_cache(device)
            release_free_memory()
        self.level, self.asleep_since = level, self.clock()
        self.sleeps_total[trigger] += 1
        log.info(
            "model %s fell asleep (level %d, %s): %d KV bytes and %d bytes of weights released",
            self.name,
            level,
            trigger,
            self._kv_bytes,
            self._weights_bytes,
        )
        return SleepResult(
            pool=self.name,
            level=level,
            trigger=trigger,
            kv_bytes=self._kv_bytes,
            weights_bytes=self._weights_bytes,
            pages_evicted=evicted,
        )

    def _park(self, member: BudgetedPool | None) -> None:
        """Shrink the empty pool to one segment (below its floor), free that one too, and
        count it for nothing in the budget."""
        engine = self.engine
        segment = engine.pool.segment_pages
        engine.resizer.resize(segment, floor=segment)
        engine.storage.park()
        if member is not None:
            member.asleep = True

    # ---- waking -------------------------------------------------------------------------

    def wake(
        self,
        trigger: WakeTrigger,
        member: BudgetedPool | None,
        make_room: MakeRoom | None,
    ) -> Future[WakeResult]:
        """Start waking the model (nothing to do when awake, nothing more while it wakes): the
        pool comes back now, the weights now or on a loader thread. The future is done when
        the model can step, or with `SleepRefused` when the wake failed (it sleeps on)."""
        future: Future[WakeResult] = Future()
        if self.awake:
            future.set_result(self._result(trigger, 0.0, woke=False))
            return future
        self._waiters.append(future)
        if self.waking:
            return future
        self._wake_started, self._wake_trigger = self.clock(), trigger
        try:
            self._restore_pool(member, make_room)
        except SleepRefused as refused:
            self._fail(str(refused), member)
            return future
        level, device, engine = self.level, self.engine.device, self.engine
        if level == 1:
            if self._weights_on_device:
                engine.move_weights(device)
            self._finish()
        else:
            reload = self.reload
            assert reload is not None  # checked before the sleep
            self._loading = _load_in_background(
                lambda: engine.serving_form(reload()), self.name, self.notify
            )
        return future

    def poll(self, member: BudgetedPool | None) -> str | None:
        """Finish a wake whose weights have loaded (engine thread, every pass of its loop).
        Returns why a wake failed, once, so that the requests waiting for it can be ended."""
        loading = self._loading
        if loading is None or not loading.done():
            return None
        self._loading = None
        error = loading.exception()
        if error is not None:
            reason = f"model {self.name!r} could not reload its weights: {error}"
            self._fail(reason, member)
            return reason
        self.engine.load_weights(loading.result())
        self._finish()
        return None

    def settle(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a reload in progress to end (at shutdown: torch
        must not be running on the loader thread while the process exits)."""
        loading = self._loading
        if loading is not None:
            wait([loading], timeout)

    def _restore_pool(self, member: BudgetedPool | None, make_room: MakeRoom | None) -> None:
        """Give the pool back its pages: those it had, as far as the budget (after taking back
        what other pools borrowed) allows, never below its floor."""
        engine = self.engine
        pool, resizer = engine.pool, engine.resizer
        segment_bytes = pool.segment_pages * pool.bytes_per_page
        target = self._pages
        if member is not None and make_room is not None:
            unassigned = make_room(target * pool.bytes_per_page)
            fits = unassigned // segment_bytes * pool.segment_pages
            floor = max(resizer.min_pages, pool.segment_pages)
            if fits < floor:
                raise SleepRefused(
                    f"model {self.name!r} needs {floor} pages to wake and the KV budget has "
                    f"room for {fits} that the other pools can give back; it sleeps on: "
                    "shrink or sleep another model (kvctl pool resize; kvctl sleep)"
                )
            target = min(target, fits)
        try:
            engine.storage.unpark()
        except (RuntimeError, MemoryError) as error:  # the device has no room for a segment
            raise SleepRefused(
                f"model {self.name!r} could not allocate its pool: {error}"
            ) from None
        if member is not None:
            member.asleep = False
        if target > pool.capacity:
            try:
                resizer.resize(target)
            except ResizeRefused as refused:  # it wakes with one segment and grows on demand
                log.warning("model %s woke with a smaller pool: %s", self.name, refused)

    def _finish(self) -> None:
        assert self._wake_started is not None
        seconds = max(0.0, self.clock() - self._wake_started)
        result = self._result(self._wake_trigger, seconds, woke=True)
        self.wake_histogram.observe(seconds)
        self.wakes_total[self._wake_trigger] += 1
        self.last_wake_seconds, self.last_wake_error = seconds, None
        self.level = self.asleep_since = self._wake_started = None
        self._kv_bytes = self._weights_bytes = 0
        log.info("model %s woke (%s) in %.3f s", self.name, result.trigger, seconds)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.set_result(result)

    def _fail(self, reason: str, member: BudgetedPool | None) -> None:
        """A wake that could not complete: back to sleep, its waiters told why."""
        log.warning("wake failed: %s", reason)
        if self.engine.storage.parked == 0:
            self._park(member)
        elif member is not None:
            member.asleep = True
        self._wake_started = None
        self.last_wake_error = reason
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.set_exception(SleepRefused(reason))

    def _result(self, trigger: WakeTrigger, seconds: float, woke: bool) -> WakeResult:
        return WakeResult(
            pool=self.name,
            level=self.level if woke else None,
            trigger=trigger,
            woke=woke,
            wake_seconds=seconds,
            capacity_pages=self.engine.pool.capacity,
            weights_reloaded=woke and self.level == 2,
        )


def _load_in_background(
    reload: Reload, name: str, notify: Callable[[], None] | None
) -> Future[LlamaModel]:
    """Run `reload` on a thread of its own; the future holds the model or the error, and
    `notify` is called once it does."""
    future: Future[LlamaModel] = Future()

    def load() -> None:
        try:
            future.set_result(reload())
        except Exception as error:
            future.set_exception(error)
        if notify is not None:
            notify()

    threading.Thread(target=load, name=f"kvctl-wake-{name}", daemon=True).start()
    return future


def _release_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
