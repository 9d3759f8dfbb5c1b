"""`kvctl simulate --scenario budget`: the three models of the multi-model scenario
(`kvctl.simulate.workloads`: Llama-2-70B, Mistral-7B, Gemma-2B) serve from one KV memory budget,
once with a static split and once with the agent's rebalancer, on the same seeded request stream.

What is real and what is modelled:

- **Real**: each model's pool is a `PagePool` (16-token pages of that model's KV) with its own
  `AutoDefrag` (the pool's default policy, scaled to the step as in the other scenarios) and
  `PoolResizer` (floor: one request of the whole 8K context, in whole segments, as the engine
  refuses requests that could not fit the pool; ceiling: the whole budget). The rebalancing side
  puts them under the agent's `KvBudget` and runs its `Rebalancer` with the *default*
  `RebalanceSettings`, fed after every step with each pool's real pressure: the pages its waiting
  requests need beyond its free pages, its failed allocations and its preemptions since the
  previous step, and its promised pages (the most pages one of its unfinished requests may reach,
  prompt + max_tokens, as the engine's `pages_promised`).
- **Modelled**: the engines. The scheduler is the simulator's (`kvctl.simulate.runner`), with one
  FIFO lane per model (each model has its own engine): a lane admits from its head while its own
  pool has the free pages the request needs now; a decode appends 16 tokens, and when its pool
  has no page for them (a failed allocation, counted by the pool) the youngest running request
  of the same model is preempted and re-queued first, to recompute later.
- **Sides**: `static` splits the budget into equal bytes, in whole segments, and never resizes;
  `rebalancing` starts from the same split. Segments are the same bytes in every pool (90 MiB,
  the smallest multiple of the three page sizes above 64 MiB), each made of its own model's
  pages (18, 45 and 320 of them).
- **Time**: one step is one decode chunk of 16 tokens; at about 31 ms a decode step on a GPU,
  that is 0.5 s (`STEP_SECONDS`), which is the rebalancer's clock. Its defaults then read: under
  pressure for 2 steps before a pool takes, calm for 20 steps before it gives, and a cooldown of
  60 steps after a move.

**The stream** (one `random.Random(seed)`): 600 steps of Poisson arrivals (5 minutes), in three
phases of 200 steps; prompts uniform 256–4K tokens, the cap and the actual output drawn as in
the allocation scenarios of `kvctl.simulate.workloads` (8K context). A model's *load* is its
share of the KV memory demand, not of the requests: a Llama-2-70B token costs 320 KiB and a
Gemma-2B token 18 KiB, so with equal request rates the equal-byte split would be wrong for every
mix and the static side a straw man. A model with load share s gets s × 2 × (320 KiB ÷ its bytes
per token) requests a step: the stream always carries the memory demand of 2 Llama-2-70B requests
a step (35–39 GiB of live KV on average), whichever model carries it. The mixes:

- `one-hot`: Llama-2-70B carries 80 % of the load all along, the two others 10 % each;
- `moving`: the same 80/10/10, the hot model changing every phase (Llama-2-70B, Mistral-7B,
  Gemma-2B), as the phases of the multi-model scenario;
- `all-busy`: a third each, so the static split is the right one.

`requests` scales the rates so that about that many arrive over the same 600 steps (the
rebalancer's timings are in seconds, so the run keeps its length).

**The budget**: `budget_fraction` (default 0.8) × the stream's peak live demand (the most bytes
of real tokens it holds at once, were memory unlimited: every request holding its prompt from
its arrival and 16 more tokens a step), rounded down to a multiple of three segments, never less
than three floors. That is 0.96–1.19 × the mean live demand (seeds 0–6): the budget would just
hold the load if it were split as the load is, so every mix is under real pressure (requests
queue and are preempted on both sides), and a wrong split is overloaded.

Reported per side: allocation failure rate (failed ÷ attempted page allocations, the pools' own
counters), preemptions and the KV bytes they dropped (to be recomputed: a 70B preemption costs
far more than a 2B one), mean utilisation of the budget (bytes of live KV ÷ budget, over the
admission period as in the other scenarios), p99 and mean queue time in steps (arrival → first
admission), requests finished by the step of the last arrival, rebalances (moves) and the bytes
they moved, pages a shrink evacuated, and per model its preemptions, failures, p99 queue time
and mean share of the budget.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

from kvctl.agent.budget import KvBudget, Pressure, Rebalancer
from kvctl.agent.pool import AutoDefrag, Defragmenter, PagePool, PoolExhausted, PoolResizer
from kvctl.load.report import percentile
from kvctl.settings import RebalanceSettings
from kvctl.simulate.backends import ManagedPool, PagedSide, RequestState, segment_bytes
from kvctl.simulate.names import BUDGET
from kvctl.simulate.runner import Simulation, SimulationConfig, StepClock, step_defrag_policy
from kvctl.simulate.workloads import (
    DECODE_CHUNK,
    GEMMA_2B,
    LLAMA_70B,
    MISTRAL_7B,
    Model,
    Request,
    Workload,
    draw_cap,
    draw_output_tokens,
    lifetime_steps,
)

MODELS = (LLAMA_70B, MISTRAL_7B, GEMMA_2B)
SIDES = ("static", "rebalancing")
MIXES = ("one-hot", "moving", "all-busy")
CONTEXT = 8192
HOT_SHARE = 0.8
"""The hot model's share of the load in `one-hot` and `moving` (the others share the rest)."""
LLAMA_RATE = 2.0
"""The stream's memory demand: that of this many Llama-2-70B requests a step."""
ARRIVAL_STEPS = 600
"""Steps of arrivals (5 minutes at 0.5 s a step): phases of 100 s in `moving`."""
DEFAULT_FRACTION = 0.8
DECODE_STEP_SECONDS = 1 / 32
"""One decode step on a GPU, about 31 ms; a step of 16 tokens is then 0.5 s."""
STEP_SECONDS = DECODE_CHUNK * DECODE_STEP_SECONDS

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class BudgetConfig:
    """Knobs of the budget scenario; the defaults are what `kvctl simulate` uses."""

    requests: int | None = None
    """About this many requests over the 600 steps (None: the rates of `LLAMA_RATE`)."""
    budget_fraction: float | None = None
    """The budget as a share of the stream's peak live demand (None: `DEFAULT_FRACTION`)."""
    mix: str = "moving"
    rebalance: RebalanceSettings | None = None
    """The rebalancer's settings (None: the agent's defaults, what `kvctl simulate` uses)."""
    page_size: int = 16
    decode_chunk: int = DECODE_CHUNK
    max_steps: int = 1_000_000

    def __post_init__(self) -> None:
        if self.mix not in MIXES:
            raise ValueError(f"unknown mix {self.mix!r}; choose one of {', '.join(MIXES)}")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be at least 1, got {self.requests}")
        if self.budget_fraction is not None and not 0 < self.budget_fraction <= 1:
            raise ValueError(f"budget_fraction must be in (0, 1], got {self.budget_fraction}")
        if self.page_size < 1 or self.decode_chunk < 1:
            raise ValueError("page_size and decode_chunk must be at least 1")

    @property
    def step_seconds(self) -> float:
        """The rebalancer's seconds in one step: `decode_chunk` decode steps."""
        return self.decode_chunk * DECODE_STEP_SECONDS

    def simulation(self) -> SimulationConfig:
        return SimulationConfig(
            page_size=self.page_size, decode_chunk=self.decode_chunk, max_steps=self.max_steps
        )


# ---- the stream and the budget ------------------------------------------------------------


def load_shares(mix: str, phase: int) -> tuple[float, ...]:
    """Each model's share of the memory demand in `phase` (0, 1, 2: thirds of the run)."""
    if mix == "all-busy":
        return (1 / 3,) * 3
    hot = phase if mix == "moving" else 0
    cold = (1 - HOT_SHARE) / 2
    return tuple(HOT_SHARE if k == hot else cold for k in range(3))


def model_rates(shares: tuple[float, ...], llama_rate: float) -> list[float]:
    """Requests a step per model that carry the memory demand of `llama_rate` Llama-2-70B
    requests a step, split by `shares` (prompts and outputs are drawn alike for every model)."""
    llama = LLAMA_70B.kv_bytes_per_token
    return [
        share * llama_rate * llama / m.kv_bytes_per_token
        for share, m in zip(shares, MODELS, strict=True)
    ]


def build_stream(mix: str, seed: int, requests: int | None = None) -> list[Request]:
    """The seeded request stream of `mix` (see the module docstring), in arrival order."""
    phases = [load_shares(mix, k) for k in range(3)]
    llama_rate = LLAMA_RATE
    if requests is not None:  # the rates that bring about `requests` over the same steps
        expected = sum(sum(model_rates(s, 1.0)) for s in phases) * ARRIVAL_STEPS / 3
        llama_rate = requests / expected
    rng = random.Random(seed)
    stream: list[Request] = []
    t = 0.0
    for k, shares in enumerate(phases):
        rates = model_rates(shares, llama_rate)
        end = ARRIVAL_STEPS * (k + 1) / 3
        while (t := t + rng.expovariate(sum(rates))) < end:
            model = rng.choices(MODELS, rates)[0]
            prompt = rng.randint(256, 4096)
            cap = draw_cap(rng, prompt, CONTEXT)
            out = draw_output_tokens(rng, cap)
            stream.append(Request(len(stream), int(t), prompt, cap, out, model.name))
        t = end  # memoryless: the next phase's arrivals start afresh at its start
    return stream


def live_demand(requests: Iterable[Request], decode_chunk: int = DECODE_CHUNK) -> list[int]:
    """Bytes of real tokens the stream holds at each step of its arrivals, were memory
    unlimited: a request holds its prompt from its arrival, then `decode_chunk` more tokens a
    step until its output is done."""
    per_token = {m.name: m.kv_bytes_per_token for m in MODELS}
    live = [0] * ARRIVAL_STEPS
    for r in requests:
        for j in range(min(lifetime_steps(r, decode_chunk), ARRIVAL_STEPS - r.arrival)):
            tokens = r.prompt_tokens + min(j * decode_chunk, r.output_tokens)
            live[r.arrival + j] += tokens * per_token[r.model]
    return live


def floor_pages(model: Model, page_size: int) -> int:
    """One request of the whole context, in whole segments: what a pool never goes below."""
    seg_pages = segment_bytes(MODELS, page_size) // (model.kv_bytes_per_token * page_size)
    pages = -(-CONTEXT // page_size)
    return -(-pages // seg_pages) * seg_pages


def build_workload(config: BudgetConfig, seed: int) -> Workload:
    """The stream of `config.mix` and its budget: `budget_fraction` × its peak live demand, in
    whole segments, a multiple of three (the static split), at least three floors."""
    fraction = DEFAULT_FRACTION if config.budget_fraction is None else config.budget_fraction
    requests = build_stream(config.mix, seed, config.requests)
    if not requests:
        raise ValueError(f"seed {seed} drew no request at this rate; ask for more requests")
    peak = max(live_demand(requests, config.decode_chunk))
    segment = segment_bytes(MODELS, config.page_size)
    floor_segments = max(
        -(-floor_pages(m, config.page_size) * m.kv_bytes_per_token * config.page_size // segment)
        for m in MODELS
    )
    share = max(int(peak * fraction) // 3 // segment, floor_segments)
    budget = 3 * share * segment
    return Workload(f"budget/{config.mix}", MODELS, tuple(requests), budget, fraction, peak)


# ---- the side -----------------------------------------------------------------------------


class BudgetSide(PagedSide):
    """One pool per model under one budget: a static equal split, or the agent's `KvBudget` and
    `Rebalancer`. It keeps the paged side's pools, release, sampling and counters, and replaces
    its ad-hoc elastic resizing: admission and decode see only the request's own pool."""

    def __init__(
        self,
        name: str,
        workload: Workload,
        config: BudgetConfig,
        clock: StepClock,
        rebalance: bool,
    ) -> None:
        self.name = name
        self.clock = clock
        self.elastic = True
        page_size = config.page_size
        self.segment_bytes = segment_bytes(workload.models, page_size)
        segments = workload.budget_bytes // self.segment_bytes
        self.budget = KvBudget(segments * self.segment_bytes)
        policy = step_defrag_policy(config.simulation())
        self.pools: dict[str, ManagedPool] = {}
        self.running: dict[str, dict[int, RequestState]] = {}
        self.waiting: Iterable[RequestState] = ()  # the simulation's queue, set by `attach`
        for model in workload.models:
            page_bytes = model.kv_bytes_per_token * page_size
            seg_pages = self.segment_bytes // page_bytes
            pages = segments // len(workload.models) * seg_pages
            pool = PagePool(pages, page_size, seg_pages, page_bytes)
            defrag = Defragmenter(pool, batch_pages=policy.step_max_pages, clock=clock)
            resizer = PoolResizer(
                pool,
                defrag,
                min_pages=floor_pages(model, page_size),
                max_pages=segments * seg_pages,
                promised=self._promised_of(model.name),
            )
            auto = AutoDefrag(defrag, policy, clock=clock)
            self.pools[model.name] = ManagedPool(pool, auto, resizer, page_bytes)
            self.running[model.name] = {}
            self.budget.add(model.name, resizer)
        self.unassigned_bytes = self.budget.unassigned_bytes
        self.grows = self.shrinks = self.evacuated_pages = 0
        self.rebalancer = (
            Rebalancer(
                self.budget,
                config.rebalance or RebalanceSettings(),
                lambda: clock.now * config.step_seconds,
            )
            if rebalance
            else None
        )
        self.rebalances = self.moved_bytes = 0
        # read at each check, before any resize
        self.promised: dict[str, int] = dict.fromkeys(self.pools, 0)
        self.queue_steps: dict[str, list[int]] = {name: [] for name in self.pools}
        self.preemptions: Counter[str] = Counter()
        self.recomputed_bytes: Counter[str] = Counter()  # KV the preempted requests drop
        self._preempted_seen: Counter[str] = Counter()
        self._failures_seen = dict.fromkeys(self.pools, 0)
        self._held = dict.fromkeys(self.pools, 0)  # bytes × steps, for the mean shares
        self._steps = 0

    def _promised_of(self, name: str) -> Callable[[], int]:
        """What pool `name` has promised at the moment of asking (its resizer's check)."""
        return lambda: self.promised[name]

    def attach(self, simulation: Simulation) -> None:
        """Read the simulation's waiting queue for pressure and promised pages."""
        self.waiting = simulation.waiting

    # ---- the scheduler's questions ------------------------------------------------------

    def looks_free(self, state: RequestState) -> bool:
        pool = self.pools[state.request.model].pool
        return pool.free_pages >= pool.pages_for(state.stored_tokens)

    def start(self, state: RequestState) -> bool:
        model = state.request.model
        try:
            self.pools[model].pool.allocate(state.id, state.stored_tokens)
        except PoolExhausted:
            return False
        if state.admitted_at < 0:  # its first admission
            self.queue_steps[model].append(self.clock.now - state.request.arrival)
        self.running[model][state.id] = state
        return True

    def extend(self, state: RequestState, tokens: int) -> bool:
        """Append as a decode step does; a failure is counted by the pool."""
        try:
            self.pools[state.request.model].pool.append(state.id, tokens)
        except PoolExhausted:
            return False
        return True

    def release(self, state: RequestState) -> None:
        super().release(state)
        del self.running[state.request.model][state.id]
        if state.remaining > 0:  # released before its end: preempted, to be recomputed
            self.preemptions[state.request.model] += 1
            self.recomputed_bytes[state.request.model] += (
                state.stored_tokens * state.kv_bytes_per_token
            )

    def housekeeping(self) -> None:
        """An auto-defrag tick per pool; then, on the rebalancing side, the rebalancer's check."""
        for mp in self.pools.values():
            mp.auto.tick()
        if self.rebalancer is not None:
            self._rebalance(self.rebalancer)
        for name, mp in self.pools.items():
            self._held[name] += mp.pool.capacity * mp.page_bytes
        self._steps += 1

    # ---- the budget ---------------------------------------------------------------------

    def pressure(self) -> dict[str, tuple[Pressure, int]]:
        """Each pool's pressure since the previous call, and its promised pages: the most pages
        one of its unfinished requests may reach (prompt + max_tokens, as the engine's
        `pages_promised`), kept in `promised` for the resizer's check."""
        needed: Counter[str] = Counter()
        longest: Counter[str] = Counter()
        for state in self.waiting:
            model = state.request.model
            needed[model] += self.pools[model].pool.pages_for(state.stored_tokens)
            longest[model] = max(longest[model], state.request.reserved_tokens)
        readings = {}
        for name, mp in self.pools.items():
            pool = mp.pool
            for state in self.running[name].values():
                longest[name] = max(longest[name], state.request.reserved_tokens)
            self.promised[name] = pool.pages_for(longest[name])
            failures = pool.alloc_failures - self._failures_seen[name]
            self._failures_seen[name] = pool.alloc_failures
            preempted = self.preemptions[name] - self._preempted_seen[name]
            self._preempted_seen[name] = self.preemptions[name]
            short = max(0, needed[name] - pool.free_pages)
            readings[name] = (Pressure(short, failures, preempted), self.promised[name])
        return readings

    def _rebalance(self, rebalancer: Rebalancer) -> None:
        rebalancer.observe(self.pressure())
        before = {name: mp.pool.capacity for name, mp in self.pools.items()}
        evacuations = {name: mp.resizer.last_evacuation for name, mp in self.pools.items()}
        moves = rebalancer.rebalance()
        self.rebalances += len(moves)
        self.moved_bytes += sum(move.taken_bytes for move in moves)
        for name, mp in self.pools.items():
            if mp.pool.capacity > before[name]:
                self.grows += 1
            elif mp.pool.capacity < before[name]:
                self.shrinks += 1
                evacuation = mp.resizer.last_evacuation
                if evacuation is not None and evacuation is not evacuations[name]:
                    self.evacuated_pages += evacuation.pages_moved
        self.unassigned_bytes = self.budget.unassigned_bytes

    def shares(self) -> dict[str, float]:
        """Each pool's mean share of the budget over the steps so far."""
        total = self.budget.total_bytes * max(1, self._steps)
        return {name: held / total for name, held in self._held.items()}


# ---- running ------------------------------------------------------------------------------


def build_run(config: BudgetConfig, seed: int, rebalance: bool) -> tuple[Simulation, BudgetSide]:
    """One side's simulation of the mix, ready to `run` or to `advance` step by step."""
    workload = build_workload(config, seed)
    clock = StepClock()
    side = BudgetSide(SIDES[rebalance], workload, config, clock, rebalance)
    sim = Simulation(
        workload,
        side,
        side.budget.total_bytes,
        clock,
        config.simulation(),
        lane=lambda state: state.request.model,
    )
    side.attach(sim)
    return sim, side


def run_side(
    config: BudgetConfig,
    seed: int,
    rebalance: bool,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run one side to the end; its figures as plain fields."""
    sim, side = build_run(config, seed, rebalance)
    last_arrival = sim.pending[-1].request.arrival
    finished_in_load = 0

    def settled(n: int) -> None:
        nonlocal finished_in_load
        if sim.step <= last_arrival + 1:  # the step just run was at most the last arrival's
            finished_in_load = sim.completed
        if progress is not None:
            progress(n)

    result = sim.run(settled)
    queue = [steps for per_model in side.queue_steps.values() for steps in per_model]
    attempts, failures = result.alloc_attempts, result.alloc_failures
    shares = side.shares()
    return {
        "requests": result.requests,
        "completed": result.completed,
        "failed": result.failed,
        "finished_in_load": finished_in_load,
        "alloc_attempts": attempts,
        "alloc_failures": failures,
        "alloc_failure_rate": round(failures / attempts if attempts else 0.0, 6),
        "preemptions": result.preemptions,
        "recomputed_bytes": sum(side.recomputed_bytes.values()),
        "utilization_mean": round(result.utilization_mean, 6),
        "queue_p99_steps": percentile(queue, 99, method="nearest") or 0,
        "queue_mean_steps": round(sum(queue) / max(1, len(queue)), 3),
        "rebalances": side.rebalances,
        "moved_bytes": side.moved_bytes,
        "pool_grows": side.grows,
        "pool_shrinks": side.shrinks,
        "pages_evacuated": side.evacuated_pages,
        "defrag_runs": result.defrag_runs,
        "steps": result.steps,
        "measured_steps": result.measured_steps,
        "budget_bytes": side.budget.total_bytes,
        "models": {
            name: {
                "requests": len(side.queue_steps[name]),
                "preemptions": side.preemptions[name],
                "recomputed_bytes": side.recomputed_bytes[name],
                "alloc_failures": mp.pool.alloc_failures,
                "queue_p99_steps": percentile(side.queue_steps[name], 99, method="nearest") or 0,
                "share_mean": round(shares[name], 6),
            }
            for name, mp in side.pools.items()
        },
    }


def run_budget(seed: int, progress: Progress | None = None, **overrides: Any) -> dict[str, Any]:
    """The budget scenario for `seed`: the same stream on a static split and with rebalancing.

    `overrides` are `BudgetConfig` fields (`requests`, `budget_fraction`, `mix`, `rebalance`,
    `page_size`, `decode_chunk`, `max_steps`); None means the default. Returns
    `{"scenario": "budget", "seed": seed, "mix": mix, "step_seconds": s,
    "results": {"static": {...}, "rebalancing": {...}}}`."""
    unknown = set(overrides) - {f.name for f in fields(BudgetConfig)}
    if unknown:
        raise TypeError(f"unknown simulation settings: {', '.join(sorted(unknown))}")
    config = BudgetConfig(**{k: v for k, v in overrides.items() if v is not None})
    count = len(build_stream(config.mix, seed, config.requests))
    results = {}
    for offset, name in enumerate(SIDES):
        done = offset * count
        report = None if progress is None else (lambda n, d=done: progress(d + n, 2 * count))
        results[name] = run_side(config, seed, bool(offset), report)
    return {
        "scenario": BUDGET,
        "seed": seed,
        "mix": config.mix,
        "step_seconds": config.step_seconds,
        "results": results,
    }
