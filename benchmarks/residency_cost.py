"""What the always-on residency figures cost: the prefix cache's clock reads and histogram
counts (page lifetime, idle time before eviction, reuse gap) against the engine's step time, on
a trace that hits and evicts all the time, and the token-slot count of each snapshot.

The trace: `--clients` closed-loop clients, each request one of 16 shared system prompts plus
32 tokens of its own, 16 tokens generated, in a pool that holds a third of the system prompts,
so nearly every admission both hits and evicts. Two sides in one process, rounds alternating:
`on` as the agent runs, `off` with the cache's clock a constant (no clock read, and nothing is
counted: a node with no time is not timed). The cost is given two ways: the difference of the
two sides' time per step (paired, median and spread), and the time attributed to the residency
code itself (its calls in a round times their cost measured alone) over the round's engine
time, the figure that holds however noisy the machine. Then the token-slot count of one
snapshot at 64 running requests, against the 100 ms between two snapshots.

    python benchmarks/residency_cost.py [--model demo|135m] [--rounds 6] [--requests 96]
"""

from __future__ import annotations

import argparse
import random
import time
import timeit

import torch
from model_shapes import MODELS, benchmark_model
from paired import command_line, environment, finish, spread, verdict

from kvctl.agent.model import SamplingParams
from kvctl.agent.prefix.residency import DurationCounts
from kvctl.agent.runtime import Engine, EngineConfig
from kvctl.agent.startup.wiring import default_torch_threads
from kvctl.settings import DefragSettings

PAGE_SIZE = 16
SYSTEM_TOKENS = 256
OWN_TOKENS = 32
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
TARGET = 0.01
"""The residency code's share of the step time the target allows."""


class Counted:
    """Counts the residency code's calls in an engine: clock reads and observations."""

    def __init__(self, engine: Engine) -> None:
        cache = engine.prefix_cache
        assert cache is not None
        self.reads = self.observations = 0
        clock = cache.clock

        def read() -> float:
            self.reads += 1
            return clock()

        cache.clock = read
        for counts in (cache.residency.lifetime, cache.residency.idle_before_evict):
            self._wrap(counts)
        self._wrap(cache.residency.reuse_gap)

    def _wrap(self, counts: DurationCounts) -> None:
        observe = counts.observe

        def counted(seconds: float, weight: int = 1) -> None:
            self.observations += 1
            observe(seconds, weight)

        counts.observe = counted  # type: ignore[method-assign]  # counting its calls, in place


def run_trace(engine: Engine, rng: random.Random, vocab: int, clients: int, requests: int) -> int:
    """The closed-loop trace to its end; the number of steps."""
    systems = [[rng.randrange(3, vocab) for _ in range(SYSTEM_TOKENS)] for _ in range(16)]

    def prompt() -> list[int]:
        return rng.choice(systems) + [rng.randrange(3, vocab) for _ in range(OWN_TOKENS)]

    sent = steps = 0
    running: list = []
    while sent < requests or engine.has_work():
        while sent < requests and len([r for r in running if r.finish_reason is None]) < clients:
            running.append(engine.add_request(prompt(), PARAMS))
            sent += 1
        engine.step()
        steps += 1
        running = [r for r in running if r.finish_reason is None]
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="demo")
    parser.add_argument("--rounds", type=int, default=6, help="even: each side first as often")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--threads", type=int, default=default_torch_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(command_line())
    print(environment())
    config, model, tokenizer = benchmark_model(args.model)
    pool_pages = 16 * SYSTEM_TOKENS // PAGE_SIZE // 3 + args.clients * 4
    per_step: dict[str, list[float]] = {"on": [], "off": []}
    shares: list[float] = []
    counts = DurationCounts()
    observe_s = min(timeit.repeat(lambda: counts.observe(3.0, 4), number=2000, repeat=5)) / 2000
    read_s = min(timeit.repeat(time.monotonic, number=20000, repeat=5)) / 20000
    for i in range(args.rounds):
        for side in ("on", "off") if i % 2 == 0 else ("off", "on"):
            engine = Engine(
                model,
                tokenizer,
                EngineConfig(
                    page_size=PAGE_SIZE,
                    pool_pages=pool_pages,
                    segment_pages=pool_pages,
                    defrag=DefragSettings(enabled=False),
                ),
            )
            cache = engine.prefix_cache
            assert cache is not None
            counted = Counted(engine) if side == "on" else None
            if side == "off":
                cache.clock = float  # float() is 0.0: no read, and nothing gets a time
            rng = random.Random(i)
            started = time.perf_counter()
            steps = run_trace(engine, rng, config.vocab_size, args.clients, args.requests)
            seconds = time.perf_counter() - started
            per_step[side].append(seconds / steps)
            if counted is not None:
                spent = counted.observations * observe_s + counted.reads * read_s
                shares.append(spent / seconds)
                evicted = engine.stats.prefix_evictions_total
                print(
                    f"round {i}: {steps} steps, {evicted} pages evicted, {counted.reads} clock "
                    f"reads, {counted.observations} observations"
                )
    ratios = sorted(a / b for a, b in zip(per_step["on"], per_step["off"], strict=True))
    print(
        f"time per step: on {spread(per_step['on'], 1e3)} ms, off {spread(per_step['off'], 1e3)} "
        f"ms; on / off {ratios[len(ratios) // 2]:.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})"
    )
    print(
        f"one observation {observe_s * 1e9:.0f} ns, one clock read {read_s * 1e9:.0f} ns; the "
        f"residency code's share of the engine's time: {spread([100 * s for s in shares])} %"
    )
    engine = Engine(model, tokenizer, EngineConfig(page_size=PAGE_SIZE, pool_pages=4096))
    for _ in range(64):
        engine.add_request([random.randrange(3, config.vocab_size) for _ in range(40)], PARAMS)
    engine.step()
    count_s = min(timeit.repeat(engine._token_slots_used, number=200, repeat=5)) / 200
    print(
        f"token slots of {len(engine.scheduler.running)} running requests: {count_s * 1e6:.1f} us "
        f"per snapshot, {100 * count_s / 0.1:.4f} % of the 100 ms between snapshots"
    )
    print(f"model: {args.model}, {torch.get_num_threads()} torch threads, pool {pool_pages} pages")
    met = max(shares) < TARGET
    print(f"residency under {TARGET:.0%} of the engine's time: {verdict(met)}")
    return finish(met)


if __name__ == "__main__":
    raise SystemExit(main())
