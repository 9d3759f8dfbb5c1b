"""Time to first token of a system-prompt request after an eviction storm, with the prompt
pinned (`kvctl prefix pin`) against not pinned.

Each side is an engine whose pool holds the system prompt a few times over. A warm-up request
caches the prompt; on the pinned side it is then pinned. Each round is a storm (unique prompts
that together need the whole pool, so every cached page that is not pinned is evicted), then one
measured request: the system prompt plus a question of its own, generating one token. TTFT is
the wall time from `add_request` to the step that returns its token. Rounds are paired and
interleaved (each side once a round, in a rotating order); the TTFTs are the median (min-max),
and the speedup the median (min-max) of the per-round ratios unpinned / pinned. The figure a pinned
prompt should keep is a device hit after the same storm in a pool large enough that the storm
evicts nothing (the same work before it, so the same state of the CPU's caches).

    python benchmarks/prefix_pin_storm.py [--model demo|135m] [--prefix-tokens 1024]
        [--rounds 7] [--threads N]
"""

from __future__ import annotations

import argparse
import random

import torch
from model_shapes import MODELS, benchmark_model
from paired import MIN_ROUNDS, Paired, command_line, environment, finish, spread, verdict
from prefix_ttft import ONE_TOKEN, time_to_first_token

from kvctl.agent.runtime import Engine, EngineConfig
from kvctl.agent.startup.wiring import default_torch_threads
from kvctl.settings import DefragSettings

PAGE_SIZE = 16
SUFFIX_TOKENS = 16
HIT_OF_DEVICE = 1.25
"""Met when the pinned side's median TTFT after a storm is within this of a device hit."""


def storm(engine: Engine, rng: random.Random, vocab: int, pages: int) -> None:
    """Unique prompts that need `pages` pages (every page of the small pools), two at a time."""
    per_prompt = max(PAGE_SIZE, (pages // 4) * PAGE_SIZE - PAGE_SIZE)
    for _ in range(4):
        prompts = [[rng.randrange(3, vocab) for _ in range(per_prompt)] for _ in range(2)]
        for prompt in prompts:
            engine.add_request(prompt, ONE_TOKEN)
        while engine.has_work():
            engine.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="demo")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7, help=f"at least {MIN_ROUNDS}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=default_torch_threads())
    args = parser.parse_args(argv)
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}")
    torch.set_num_threads(args.threads)
    print(command_line())
    print(environment())
    config, model, tokenizer = benchmark_model(args.model)
    vocab = config.vocab_size
    rng = random.Random(args.seed)
    system = [rng.randrange(3, vocab) for _ in range(args.prefix_tokens)]
    pool_pages = 4 * -(-(args.prefix_tokens + SUFFIX_TOKENS) // PAGE_SIZE)
    engines: dict[str, Engine] = {}
    for side, pages in (
        ("pinned", pool_pages),
        ("not pinned", pool_pages),
        ("roomy", 3 * pool_pages),
    ):
        engine = Engine(
            model,
            tokenizer,
            EngineConfig(
                page_size=PAGE_SIZE,
                pool_pages=pages,
                segment_pages=pages,
                defrag=DefragSettings(enabled=False),
            ),
        )
        time_to_first_token(engine, system + [5] * SUFFIX_TOKENS)  # warm-up: caches the prompt
        if side == "pinned":
            assert engine.prefix_ops is not None
            engine.prefix_ops.max_pinned_share = 0.5
            pin = engine.prefix_ops.pin(None, system, ttl_s=None)
            print(f"pinned {pin.tokens} tokens in {pin.pages} of {pool_pages} pages")
        engines[side] = engine
    served: dict[str, list[int]] = {side: [] for side in engines}

    def request(side: str) -> float:
        engine = engines[side]
        storm(engine, rng, vocab, pool_pages)
        question = [rng.randrange(3, vocab) for _ in range(SUFFIX_TOKENS)]
        seconds, hit = time_to_first_token(engine, system + question)
        served[side].append(hit)
        return 1 / seconds

    rates: dict[str, list[float]] = {side: [] for side in engines}
    sides = list(engines)
    for i in range(args.rounds):  # every round measures each side once, in a rotating order
        for side in sides[i % 3 :] + sides[: i % 3]:
            rates[side].append(request(side))
    paired = Paired(rates["pinned"], rates["not pinned"])
    to_hit = Paired([1 / r for r in rates["pinned"]], [1 / r for r in rates["roomy"]])
    assert engines["not pinned"].stats.prefix_evictions_total > 0, "the storm evicted nothing"
    assert min(served["roomy"]) == args.prefix_tokens, "the roomy pool lost the prompt"
    for side in engines:
        cached = sorted(served[side])[len(served[side]) // 2]
        print(
            f"{side:10s}: TTFT after a storm {spread([1 / r for r in rates[side]], 1e3)} ms, "
            f"prompt tokens from the cache {cached} of {args.prefix_tokens + SUFFIX_TOKENS}"
        )
    print(
        "pinned after a storm ÷ a device hit after the same storm in a pool it does not fill "
        f"(roomy), per round: {to_hit.ratio_summary()}"
    )
    print(
        f"model: {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
        f"parameters), {torch.get_num_threads()} torch threads, page size {PAGE_SIZE}"
    )
    met = to_hit.median_ratio <= HIT_OF_DEVICE and min(served["pinned"]) > 0
    print(
        f"speedup not pinned / pinned: {paired.ratio_summary()}; pinned keeps a device hit's "
        f"TTFT (within {HIT_OF_DEVICE}x): {verdict(met)}"
    )
    return finish(met)


if __name__ == "__main__":
    raise SystemExit(main())
