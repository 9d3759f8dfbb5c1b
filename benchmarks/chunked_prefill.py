"""Inter-token gaps of decoding streams while a long prompt arrives, with and without chunked
prefill, on the demo model or a 135M Llama's shapes.

Each round, `--streams` requests decode (64-token prompts) for `--warm-steps` steps; the median
gap between their tokens there is the steady gap. Then a `--prompt-tokens` prompt (fresh random
tokens: no prefix hit) arrives; every gap of every stream until that prompt's first token is a
gap "during its prefill". Without chunking (a budget above the prompt) one step computes the whole
prompt and every stream waits for it; with a budget of B tokens a step computes the streams'
decode tokens and B - streams tokens of the prompt, in one forward pass.

Rounds are paired and interleaved (chunked, unchunked, unchunked, chunked, ...); each side
reports p50/p99/max of the gaps during the prefill (median, min-max over rounds), the max gap
over the steady gap, and the prompt's time to first token. `--sweep` runs every budget of
`--budgets` in each round instead (rotating the order) and prints one row per budget.

`--model 135m` swaps the demo model (3.2 M parameters) for SmolLM-135M's shapes (30 layers, 9
query and 3 KV heads of 64, hidden 576, vocab 49152, tied embeddings) with seeded random fp32
weights: the size the issue was reported on, where a step's matmuls dominate and the demo
model's per-step overheads do not.

    python benchmarks/chunked_prefill.py [--model demo|135m] [--budget 512] [--streams 8]
        [--prompt-tokens 1600] [--rounds 7] [--sweep --budgets 64,128,256,512,1024,2048]
        [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch
from model_shapes import smollm_135m_shape
from paired import (
    MIN_ROUNDS,
    command_line,
    environment,
    finish,
    load_average,
    paired_rounds,
    spread,
    verdict,
)

from kvctl.agent.config import DEFAULT_MAX_BATCHED_TOKENS
from kvctl.agent.model import LlamaModel, SamplingParams, Tokenizer, build_demo_model
from kvctl.agent.runtime import Engine, EngineConfig
from kvctl.agent.startup.wiring import default_torch_threads
from kvctl.settings import DefragSettings

UNCHUNKED = 1 << 20
TARGET = 3.0  # max gap during the prefill / steady median gap


def build_model(name: str, seed: int = 0) -> tuple[LlamaModel, Tokenizer | None]:
    """The demo model, or SmolLM-135M's shape with weights drawn from `seed` and no tokenizer
    (its ids exceed the byte tokenizer's; the engine then streams token ids)."""
    if name == "demo":
        _, model, tokenizer = build_demo_model("cpu", torch.float32, seed=seed)
        return model, tokenizer
    _, model, _ = build_demo_model("cpu", torch.float32, seed=seed, config=smollm_135m_shape())
    return model, None


@dataclass(frozen=True)
class Round:
    steady: float  # median gap before the prompt arrives, s
    gaps: list[float]  # every stream's gaps until the prompt's first token, s
    ttft: float  # the prompt's time to first token, s

    def percentile(self, q: float) -> float:
        ordered = sorted(self.gaps)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_round(engine: Engine, args: argparse.Namespace, rng: random.Random) -> Round:
    def tokens(n: int) -> list[int]:
        return [rng.randrange(32, 127) for _ in range(n)]

    cap = engine.scheduler.prefill_while_decoding or UNCHUNKED
    per_step = max(1, min(engine.config.max_batched_tokens - args.streams, cap))
    steps = (args.prompt_tokens + 64 * args.streams) // per_step  # the streams' prompts too
    params = SamplingParams(
        temperature=0, max_tokens=args.warm_steps + 2 * steps + 32, ignore_eos=True
    )
    streams = [engine.add_request(tokens(64), params) for _ in range(args.streams)]
    last: dict[str, float] = {}
    steady: list[float] = []
    gaps: list[float] = []
    while not all(s.output_ids for s in streams):
        engine.step()
    for _ in range(args.warm_steps):
        events = engine.step()
        now = time.perf_counter()
        for e in events:
            if e.request_id in last:
                steady.append(now - last[e.request_id])
            last[e.request_id] = now
    started = time.perf_counter()
    long = engine.add_request(
        tokens(args.prompt_tokens), SamplingParams(temperature=0, max_tokens=1)
    )
    while not long.output_ids:
        events = engine.step()
        now = time.perf_counter()
        for e in events:
            if e.request_id in last:
                gaps.append(now - last[e.request_id])
                last[e.request_id] = now
    ttft = time.perf_counter() - started
    for s in streams:
        if s.finished:
            raise RuntimeError("a stream ended during the prefill: raise its max_tokens")
        engine.abort(s.request_id)
    while engine.has_work():
        engine.step()
    return Round(statistics.median(steady), gaps, ttft)


def make_engine(model, tokenizer, budget: int, args: argparse.Namespace, cap: int = 0) -> Engine:
    """An engine with `budget` tokens a step and `cap` prompt tokens a step while streams
    decode (0: no cap)."""
    return Engine(
        model,
        tokenizer,
        EngineConfig(
            pool_pages=1024,
            segment_pages=128,
            max_batched_tokens=budget,
            max_batch_seqs=min(64, budget),
            max_prefill_while_decoding=cap,
            defrag=DefragSettings(enabled=False),
            prefix_cache=True,
        ),
    )


def describe(label: str, rounds: list[Round]) -> str:
    p50 = [r.percentile(0.5) for r in rounds]
    p99 = [r.percentile(0.99) for r in rounds]
    worst = [max(r.gaps) for r in rounds]
    over = [max(r.gaps) / r.steady for r in rounds]
    ttft = spread([r.ttft for r in rounds], 1e3, ".0f")
    return (
        f"{label}: steady gap {spread([r.steady for r in rounds], 1e3)} ms; during the prefill "
        f"p50 {spread(p50, 1e3)} ms, p99 {spread(p99, 1e3)} ms, max {spread(worst, 1e3)} ms "
        f"= {spread(over, 1, '.1f')}x steady; TTFT {ttft} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget",
        type=int,
        default=DEFAULT_MAX_BATCHED_TOKENS,
        help="chunked side's tokens per step",
    )
    parser.add_argument("--model", choices=("demo", "135m"), default="demo")
    parser.add_argument(
        "--prefill-cap",
        type=int,
        default=0,
        help="chunked side's prompt tokens a step while streams decode (default 0, the agent's: "
        "no cap); the sweep runs without a cap",
    )
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1600)
    parser.add_argument("--warm-steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--sweep", action="store_true", help="every budget of --budgets a round")
    parser.add_argument("--budgets", default="64,128,256,512,1024,2048")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=default_torch_threads())
    args = parser.parse_args(argv)
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}: fewer pairs say little")
    torch.set_num_threads(args.threads)
    print(command_line())
    print(environment())
    model, tokenizer = build_model(args.model)
    rng = random.Random(args.seed)
    print(
        f"model: {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
        "parameters, fp32), "
        f"{args.streams} streams decoding, a {args.prompt_tokens}-token prompt arrives"
    )
    if args.sweep:
        budgets = [int(b) for b in args.budgets.split(",")] + [UNCHUNKED]
        engines = {b: make_engine(model, tokenizer, b, args) for b in budgets}
        results: dict[int, list[Round]] = {b: [] for b in budgets}
        for engine in engines.values():
            one_round(engine, args, rng)  # warm-up
        for i in range(args.rounds):
            shift = i % len(budgets)
            for b in budgets[shift:] + budgets[:shift]:
                results[b].append(one_round(engines[b], args, rng))
        for b in budgets:
            print(describe(f"budget {'unchunked' if b == UNCHUNKED else b:>9}", results[b]))
        print(load_average())
        return 0
    engines = {
        args.budget: make_engine(model, tokenizer, args.budget, args, args.prefill_cap),
        UNCHUNKED: make_engine(model, tokenizer, UNCHUNKED, args),
    }
    for engine in engines.values():
        one_round(engine, args, rng)  # warm-up
    rounds: dict[int, list[Round]] = {args.budget: [], UNCHUNKED: []}

    def side(budget: int) -> float:
        result = one_round(engines[budget], args, rng)
        rounds[budget].append(result)
        return max(result.gaps)

    paired = paired_rounds(lambda: side(args.budget), lambda: side(UNCHUNKED), args.rounds)
    print(describe("without chunking      ", rounds[UNCHUNKED]))
    cap = engines[args.budget].scheduler.prefill_while_decoding
    print(describe(f"chunked, budget {args.budget}, cap {cap}", rounds[args.budget]))
    print(f"max gap chunked / unchunked: {paired.ratio_summary()}")
    worst = statistics.median(max(r.gaps) / r.steady for r in rounds[args.budget])
    met = worst < TARGET
    print(f"chunked max gap / steady gap: {worst:.1f}x (target < {TARGET:.0f}x): {verdict(met)}")
    return finish(met)


if __name__ == "__main__":
    raise SystemExit(main())
