"""Effective prefix hit rate on a capacity-limited multi-turn trace, with and without a host
tier, and what the tier's stores cost the steps they run in.

The trace: 24 conversations of 6 turns sharing a 256-token system prompt; each turn sends the
whole conversation so far (system prompt, earlier turns and answers) plus a new user message of
32-96 tokens and generates a 32-64-token answer (greedy, EOS ignored). Turns go round the
conversations in a shuffled order, 8 requests at a time. The device pool holds a quarter of the
trace's working set (the pages of every conversation at its end), so by the time a
conversation comes back most of its pages have been evicted: without a tier they are
recomputed, with one they come back from host memory. Both runs use the agent's defaults
otherwise (page size 16, chunked prefill at 256 tokens a step, LRU).

Reported per run: the hit rate (prompt tokens reused / looked up, split by tier), the wall time
of the trace, and the time the tier's stores took within the steps they ran in (the stall they
add to those steps: evictions happen while a step admits requests or grows their pages). The
runs alternate (paired rounds); the generated tokens must be the same in both.

    python benchmarks/tier_hit_rate.py [--model demo|135m] [--rounds 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch
from model_shapes import MODELS, benchmark_model
from paired import MIN_ROUNDS, command_line, environment, load_average, spread

from kvctl.agent.model import SamplingParams
from kvctl.agent.pool.storage import KVStorage
from kvctl.agent.runtime import Engine, EngineConfig
from kvctl.agent.startup.wiring import default_torch_threads

CONVERSATIONS, TURNS, WAVE, SYSTEM = 24, 6, 8, 256
PAGE = 16


@dataclass
class Turn:
    conversation: int
    user: list[int]
    answer_tokens: int


def make_trace(vocab: int, seed: int = 0) -> tuple[list[int], list[Turn]]:
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(SYSTEM)]
    turns = []
    for _ in range(TURNS):
        order = list(range(CONVERSATIONS))
        rng.shuffle(order)
        for c in order:
            user = [rng.randrange(vocab) for _ in range(rng.randint(32, 96))]
            turns.append(Turn(c, user, rng.randint(32, 64)))
    return system, turns


def working_set_pages(system: list[int], turns: list[Turn]) -> int:
    """Pages of every conversation at its end, the shared system prompt counted once."""
    lengths = [0] * CONVERSATIONS
    for t in turns:
        lengths[t.conversation] += len(t.user) + t.answer_tokens
    return SYSTEM // PAGE + sum(-(-n // PAGE) for n in lengths)


@dataclass
class Run:
    seconds: float
    queries: int
    hits: dict[str, int]
    outputs: list[list[int]]
    store_ms_per_storing_step: list[float]
    step_ms: list[float]  # every step's wall time

    @property
    def hit_ratio(self) -> float:
        return sum(self.hits.values()) / self.queries


def run(engine: Engine, system: list[int], turns: list[Turn]) -> Run:
    history = [list(system) for _ in range(CONVERSATIONS)]
    outputs: list[list[int]] = []
    store_ms: list[float] = []
    step_times: list[float] = []
    tiers = engine.tiers
    before = engine.stats
    started = time.perf_counter()
    for i in range(0, len(turns), WAVE):
        wave = turns[i : i + WAVE]
        requests = []
        for t in wave:
            params = SamplingParams(temperature=0, max_tokens=t.answer_tokens, ignore_eos=True)
            requests.append(engine.add_request(history[t.conversation] + t.user, params))
        while engine.has_work():
            stored = sum(t.counters.store_seconds for t in tiers.stats()) if tiers else 0.0
            step_started = time.perf_counter()
            engine.step()
            step_ms = (time.perf_counter() - step_started) * 1000
            after = sum(t.counters.store_seconds for t in tiers.stats()) if tiers else 0.0
            if after > stored:
                store_ms.append((after - stored) * 1000)
            step_times.append(step_ms)
        for t, r in zip(wave, requests, strict=True):
            history[t.conversation] += t.user + r.output_ids
            outputs.append(r.output_ids)
    seconds = time.perf_counter() - started
    stats = engine.stats
    hits = {
        k: v - before.prefix_hits_by_tier.get(k, 0) for k, v in stats.prefix_hits_by_tier.items()
    }
    queries = stats.prefix_queries_tokens - before.prefix_queries_tokens
    return Run(seconds, queries, hits, outputs, store_ms, step_times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="demo")
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    args = parser.parse_args(argv)
    torch.set_num_threads(default_torch_threads())
    model_config, model, _ = benchmark_model(args.model)
    system, turns = make_trace(model_config.vocab_size)
    working = working_set_pages(system, turns)
    device_pages = -(-working // 4 // 32) * 32

    def engine(tiered: bool) -> Engine:
        mc = model_config
        page_bytes = KVStorage.page_bytes(
            PAGE, mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.float32
        )
        return Engine(
            model,
            None,
            EngineConfig(
                pool_pages=device_pages,
                segment_pages=32,
                host_tier_bytes=working * page_bytes if tiered else 0,
            ),
        )

    print(environment())
    print(command_line())
    print(
        f"# {args.model} model; trace: {CONVERSATIONS} conversations x {TURNS} turns, "
        f"working set {working} pages; device pool {device_pages} pages; host tier "
        f"{working} pages (with) or none (without); {args.rounds} paired rounds"
    )
    results: dict[bool, list[Run]] = {False: [], True: []}
    for r in range(args.rounds):
        for tiered in (r % 2 == 0, r % 2 != 0):
            results[tiered].append(run(engine(tiered), system, turns))
    for a, b in zip(results[False], results[True], strict=True):
        assert a.outputs == b.outputs, "the tier changed the generated tokens"
    for tiered in (False, True):
        runs = results[tiered]
        first = runs[0]
        split = ", ".join(f"{k} {v / first.queries:.1%}" for k, v in first.hits.items())
        name = "with host tier" if tiered else "device only   "
        print(
            f"{name}: hit rate {first.hit_ratio:.1%} ({split}); trace "
            f"{spread([x.seconds for x in runs])} s in {len(first.step_ms)} steps"
        )
    ratio = [a.seconds / b.seconds for a, b in zip(results[False], results[True], strict=True)]
    print(f"trace time, device only / with host tier: {spread(ratio)}x")
    stores = sorted(ms for x in results[True] for ms in x.store_ms_per_storing_step)
    if stores:
        p99 = stores[min(len(stores) - 1, int(0.99 * len(stores)))]
        share = [sum(x.store_ms_per_storing_step) / sum(x.step_ms) for x in results[True]]
        steps = [len(x.store_ms_per_storing_step) / len(x.step_ms) for x in results[True]]
        print(
            f"stores ran in {spread(steps, 100, '.0f')} % of the steps; within such a step they "
            f"took median {statistics.median(stores):.2f} ms, p99 {p99:.2f} ms, max "
            f"{stores[-1]:.2f} ms; {spread(share, 100)} % of all step time"
        )
    print(load_average())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
