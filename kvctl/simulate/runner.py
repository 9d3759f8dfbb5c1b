"""Discrete-step replay of one workload against the contiguous and the paged allocator: the
library every scenario steps with (`Simulation`, its config, clock and result) and the run of the
three allocation scenarios (`run_allocators`). Which scenario a name runs is decided by
`kvctl.simulate.scenarios`, which imports this module and never the other way round.

Both sides see the same requests, the same budget and the same scheduler; only the memory differs.
One step reads as the story of a serving engine:

1. **arrive** — requests whose arrival step has come join the waiting queue;
2. **admit** — the scheduler admits waiting requests FIFO while memory *looks* free: total free
   memory ≥ what the request needs right now (its prompt, plus already generated tokens for a
   preempted request that must recompute them). The check is deliberately naive and identical on
   both sides; it is how "allocations fail while memory looks free" happens. Admission stops at the
   first request that does not look like it fits (FIFO, no overtaking). With *lanes* (one per
   model in `kvctl.simulate.budget`, where each model has its own pool and engine) the queue is
   FIFO per lane: a lane stops at its first request that does not fit, the others go on;
3. **allocate** — an admitted request allocates. Contiguous: prompt + max output as one range; if
   no single free range holds it, that is an out-of-memory error: the request is dropped (its client
   gets the error, as a server without paging returns it) and admission goes on with the next one.
   So every request gets exactly one allocation attempt, and the failure rate does not depend on
   how finely time is cut into steps (a retry-later rule would fail more often with shorter steps).
   Paged: pages for the prompt; the check above guarantees them for one model. With several models
   a pool may first need to grow; if no room can be made the request waits at the head of the
   queue (`deferred`), which is not a failure;
4. **decode** — every running request admitted before this step generates `decode_chunk` tokens
   (fewer at the end), oldest first. Contiguous: already reserved. Paged: `append`; when pages run
   out, the youngest running request (of the same lane) is preempted (its pages freed, put back at
   the head of the queue to recompute later) until the append fits;
5. **finish** — requests that produced all their output free their memory;
6. **housekeeping** — paged: an `AutoDefrag` tick per pool and, with several models, giving back
   segments of pools that stay underused;
7. **sample** — utilisation, reservation, fragmentation and free extents of this step.

A request that could not fit even an empty device is failed on both sides (never the case at the
default budgets). The run ends when every request has completed or failed.

Metrics (per side): `failure_rate` is the share of requests that hit out-of-memory after the
scheduler admitted them. Per-step means and peaks are taken over the *admission period*: from the
first step to the last step at which a request was admitted or failed at admission (`measured_steps`
of them). That is when each allocator decides who gets memory; after it the device only drains
its longest requests, a ramp-down set by the workload's tail rather than by the allocator, which
would otherwise dilute both sides' means by different amounts.
`utilization_mean` is the share of the budget holding real tokens (stored tokens × bytes per token
÷ budget); `reserved_mean` the share held by ranges or pages, filled or not;
`fragmentation_mean`/`_peak` describe the free space (1 − largest free run ÷ free, in bytes; with
several pools 1 − Σ largest runs ÷ Σ free, the share of free memory outside its pool's largest run;
budget not yet carved into pools is not free space of any pool). `defrag_pages_moved` includes the
pages a shrink had to evacuate.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvctl.settings import DefragSettings
from kvctl.simulate.backends import (
    ContiguousSide,
    MemorySample,
    PagedSide,
    RequestState,
    Side,
    usable_budget,
)
from kvctl.simulate.contiguous import OutOfMemory
from kvctl.simulate.workloads import DECODE_CHUNK, Workload, build_workload

Progress = Callable[[int, int], None]
"""Told (requests settled so far, total) across both sides, at most once per step."""

Lane = Callable[[RequestState], str]
"""Which queue a request waits in and which running requests it may preempt."""


@dataclass(frozen=True)
class SimulationConfig:
    """Knobs of a run; the defaults are what `kvctl simulate` uses."""

    requests: int | None = None  # None: the scenario's default
    budget_fraction: float | None = None  # None: the scenario's default
    page_size: int = 16
    decode_chunk: int = DECODE_CHUNK
    max_steps: int = 1_000_000

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.decode_chunk < 1:
            raise ValueError("page_size and decode_chunk must be at least 1")


@dataclass(frozen=True)
class SimulationResult:
    """What one allocator did with one workload; every ratio is 0–1."""

    requests: int
    completed: int
    failed: int
    failure_rate: float
    preemptions: int
    deferred: int
    steps: int
    measured_steps: int
    budget_bytes: int
    utilization_mean: float
    reserved_mean: float
    fragmentation_mean: float
    fragmentation_peak: float
    free_extents_mean: float
    alloc_attempts: int
    alloc_failures: int
    defrag_runs: int
    defrag_pages_moved: int
    pool_grows: int
    pool_shrinks: int

    def to_dict(self) -> dict[str, Any]:
        """Plain fields for JSON, ratios rounded to 6 digits."""
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


RESULT_KEYS = tuple(f.name for f in fields(SimulationResult))


class StepClock:
    """Simulated time in steps: what the defragmenter and its policy read instead of wall time."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> float:
        return float(self.now)


def one_lane(state: RequestState) -> str:
    """Every request in one queue: the three allocation scenarios of `kvctl.simulate.workloads`."""
    return ""


class Simulation:
    """Replays one workload against one side, one step at a time."""

    def __init__(
        self,
        workload: Workload,
        side: Side,
        budget_bytes: int,
        clock: StepClock,
        config: SimulationConfig,
        lane: Lane = one_lane,
    ) -> None:
        self.side = side
        self.lane = lane
        self.budget = budget_bytes
        self.clock = clock
        self.config = config
        per_token = {m.name: m.kv_bytes_per_token for m in workload.models}
        self.pending = deque(RequestState(r, per_token[r.model]) for r in workload.requests)
        self.total = len(self.pending)
        self.lanes = len({lane(state) for state in self.pending})
        self.waiting: deque[RequestState] = deque()
        self.running: dict[int, RequestState] = {}
        self.running_in: Counter[str] = Counter()  # running requests per lane
        self.stored_bytes = 0
        self.completed = self.failed = self.preemptions = self.deferred = 0
        self._samples: list[tuple[float, MemorySample]] = []
        self._last_admission = 0

    @property
    def step(self) -> int:
        return self.clock.now

    @property
    def settled(self) -> int:
        return self.completed + self.failed

    def run(self, progress: Callable[[int], None] | None = None) -> SimulationResult:
        """Step until every request has completed or failed; `progress` gets the settled count."""
        while self.settled < self.total:
            if self.step >= self.config.max_steps:
                raise RuntimeError(f"{self.side.name}: no end after {self.step} steps")
            before = self.settled
            self.advance()
            if progress is not None and self.settled != before:
                progress(self.settled)
        return self.result()

    def advance(self) -> None:
        """One step: arrive → admit and allocate → decode → finish → housekeeping → sample."""
        self._arrive()
        self._admit()
        self._decode()
        self._finish()
        self.side.housekeeping()
        self._sample()
        self.clock.now += 1

    # ---- the steps ----------------------------------------------------------------------

    def _arrive(self) -> None:
        while self.pending and self.pending[0].request.arrival <= self.step:
            self.waiting.append(self.pending.popleft())

    def _admit(self) -> None:
        waiting, side = self.waiting, self.side
        blocked: set[str] = set()  # lanes whose head does not fit: the rest of them waits
        passed: list[RequestState] = []  # their requests, in queue order
        while waiting and len(blocked) < self.lanes:
            state = waiting[0]
            lane = self.lane(state)
            if lane in blocked:
                passed.append(waiting.popleft())
                continue
            if not side.looks_free(state):
                if self.running_in[lane]:
                    blocked.add(lane)
                    continue
                waiting.popleft()  # larger than the whole device: it can never run
                self._fail(state)
                continue
            waiting.popleft()
            try:
                started = side.start(state)
            except OutOfMemory:
                self._fail(state)
                continue
            if not started:
                if not self.running_in[lane]:
                    self._fail(state)
                    continue
                waiting.appendleft(state)
                self.deferred += 1
                blocked.add(lane)
                continue
            state.admitted_at = self._last_admission = self.step
            self.running[state.id] = state
            self.running_in[lane] += 1
            self.stored_bytes += state.stored_tokens * state.kv_bytes_per_token
        waiting.extendleft(reversed(passed))

    def _decode(self) -> None:
        chunk = self.config.decode_chunk
        for rid in sorted(self.running):
            state = self.running.get(rid)
            if state is None or state.admitted_at == self.step:
                continue
            tokens = min(chunk, state.remaining)
            while not self.side.extend(state, tokens):
                lane = self.lane(state)
                if self.running_in[lane] == 1:
                    self._drop_running(state)
                    self._fail(state)
                    break
                victim = self.running[
                    max(rid for rid, other in self.running.items() if self.lane(other) == lane)
                ]
                self._preempt(victim)
                if victim is state:
                    break
            else:
                state.generated += tokens
                self.stored_bytes += tokens * state.kv_bytes_per_token

    def _finish(self) -> None:
        for state in [s for s in self.running.values() if s.remaining == 0]:
            self._drop_running(state)
            self.completed += 1

    def _sample(self) -> None:
        self._samples.append((self.stored_bytes / self.budget, self.side.sample()))

    # ---- request transitions ------------------------------------------------------------

    def _drop_running(self, state: RequestState) -> None:
        self.side.release(state)
        del self.running[state.id]
        self.running_in[self.lane(state)] -= 1
        self.stored_bytes -= state.stored_tokens * state.kv_bytes_per_token

    def _preempt(self, state: RequestState) -> None:
        self._drop_running(state)
        state.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(state)

    def _fail(self, state: RequestState) -> None:
        state.failed = True
        self.failed += 1
        self._last_admission = self.step

    def result(self) -> SimulationResult:
        window = self._samples[: self._last_admission + 1]
        n = max(1, len(window))
        frag = [sample.fragmentation for _, sample in window]
        return SimulationResult(
            requests=self.total,
            completed=self.completed,
            failed=self.failed,
            failure_rate=self.failed / self.total,
            preemptions=self.preemptions,
            deferred=self.deferred,
            steps=self.step,
            measured_steps=len(window),
            budget_bytes=self.budget,
            utilization_mean=sum(u for u, _ in window) / n,
            reserved_mean=sum(s.reserved_bytes for _, s in window) / self.budget / n,
            fragmentation_mean=sum(frag) / n,
            fragmentation_peak=max(frag, default=0.0),
            free_extents_mean=sum(s.free_extents for _, s in window) / n,
            **self.side.counters(),
        )


def run_allocators(
    name: str, seed: int, progress: Progress | None = None, **overrides: Any
) -> dict[str, Any]:
    """Run allocation scenario `name` (`kvctl.simulate.workloads.SCENARIOS`) with `seed` on both
    allocators under the same budget.

    `overrides` are `SimulationConfig` fields (`requests`, `budget_fraction`, `page_size`,
    `decode_chunk`, `max_steps`). Returns exactly
    `{"scenario": name, "seed": seed, "results": {"contiguous": {...}, "paged": {...}}}`.
    """
    unknown = set(overrides) - {f.name for f in fields(SimulationConfig)}
    if unknown:
        raise TypeError(f"unknown simulation settings: {', '.join(sorted(unknown))}")
    config = SimulationConfig(**overrides)
    workload = build_workload(
        name, seed, config.requests, config.budget_fraction, config.decode_chunk
    )
    budget = usable_budget(workload, config.page_size)
    total = 2 * len(workload.requests)
    results: dict[str, Any] = {}
    for offset, make_side in enumerate((contiguous_side, paged_side)):
        clock = StepClock()
        side = make_side(workload, budget, config, clock)
        done = offset * len(workload.requests)
        report = None if progress is None else (lambda n, done=done: progress(done + n, total))
        sim = Simulation(workload, side, budget, clock, config)
        results[side.name] = sim.run(report).to_dict()
    return {"scenario": name, "seed": seed, "results": results}


def contiguous_side(
    workload: Workload, budget: int, config: SimulationConfig, clock: StepClock
) -> Side:
    """One first-fit arena of the whole budget, shared by every model."""
    return ContiguousSide(budget)


def paged_side(workload: Workload, budget: int, config: SimulationConfig, clock: StepClock) -> Side:
    """Paged pools under the pool's default defrag policy, scaled to the simulated step."""
    return PagedSide(workload, budget, config.page_size, step_defrag_policy(config), clock)


def step_defrag_policy(config: SimulationConfig) -> DefragSettings:
    """The pool's default defrag policy, scaled to the simulated step.

    The clock counts steps, so thresholds are checked every step; one step stands for
    `decode_chunk` engine steps, so it gets that many ticks' worth of page budget.
    """
    base = DefragSettings()
    return DefragSettings(
        check_interval_s=1.0, step_max_pages=base.step_max_pages * config.decode_chunk
    )
