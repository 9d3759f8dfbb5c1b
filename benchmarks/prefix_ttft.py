"""Time to first token with and without the prefix cache, on the demo model, for a shared prefix.

Each measured request is a 1,000-token shared prefix (a system prompt) plus a 16-token question of
its own, generating one token, with nothing else running. TTFT is the wall time from
`add_request` to the step that returns its token. Without the cache every request computes all
1,016 tokens. With it, a warm-up request computes the prefix once; each measured request then
adopts the cached pages and computes only its own tokens (at page size 16 the prefix ends
mid-page, 1,000 = 62 × 16 + 8, so the partly filled page is copied first).

Both engines are warmed up with one unmeasured request and run in the same process on the same
device. Rounds are paired and interleaved (cached, uncached, uncached, cached, ...), one request
per side and round; TTFTs are the median (min-max) over the rounds, and the speedup the median
(min-max) of the per-round ratios uncached TTFT / cached TTFT.

    python benchmarks/prefix_ttft.py [--prefix-tokens 1000] [--suffix-tokens 16] [--rounds 9]
        [--page-size 16] [--device cpu] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from paired import (
    MIN_ROUNDS,
    command_line,
    environment,
    finish,
    paired_rounds,
    spread,
    verdict,
)

from kvctl.agent.model import SamplingParams, build_demo_model
from kvctl.agent.runtime import Engine, EngineConfig
from kvctl.agent.startup.wiring import default_torch_threads
from kvctl.settings import DefragSettings

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
TARGET_SPEEDUP = 5.0


def time_to_first_token(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds until the request's first token, and the prompt tokens the cache served."""
    started = time.perf_counter()
    request = engine.add_request(prompt, ONE_TOKEN)
    while not request.output_ids:
        engine.step()
    elapsed = time.perf_counter() - started
    while engine.has_work():
        engine.step()
    return elapsed, request.cached_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument(
        "--rounds", "--repeat", type=int, default=9, help=f"paired rounds (at least {MIN_ROUNDS})"
    )
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=default_torch_threads(),
        help="torch CPU threads (default: the agent's, cores - 1)",
    )
    args = parser.parse_args(argv)
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}: fewer pairs say little")
    torch.set_num_threads(args.threads)
    print(command_line())
    print(environment())

    _, model, tokenizer = build_demo_model(args.device, torch.float32, seed=0)
    rng = random.Random(args.seed)

    def text_tokens(n: int) -> list[int]:
        return [rng.randrange(32, 127) for _ in range(n)]  # printable bytes of the byte tokenizer

    prefix = [tokenizer.BOS, *text_tokens(args.prefix_tokens - 1)]
    prompts = [prefix + text_tokens(args.suffix_tokens) for _ in range(2 * args.rounds + 2)]
    pages = 2 * -(-(args.prefix_tokens + args.suffix_tokens) // args.page_size) * (args.rounds + 2)
    engines = {}
    for cached in (True, False):
        config = EngineConfig(
            device=args.device,
            page_size=args.page_size,
            pool_pages=pages,
            segment_pages=pages,
            defrag=DefragSettings(enabled=False),
            prefix_cache=cached,
        )
        engines[cached] = Engine(model, tokenizer, config)
        # warm-up; with the cache it also caches the prefix
        time_to_first_token(engines[cached], prompts.pop())
    served: dict[bool, list[int]] = {True: [], False: []}

    def request(cached: bool) -> float:
        """One request on one side; its first-token rate (so cached / uncached is the speedup)."""
        seconds, hit = time_to_first_token(engines[cached], prompts.pop())
        served[cached].append(hit)
        return 1 / seconds

    paired = paired_rounds(lambda: request(True), lambda: request(False), args.rounds)
    length = args.prefix_tokens + args.suffix_tokens
    for cached, rates in ((False, paired.base), (True, paired.ours)):
        label = "with prefix cache   " if cached else "without prefix cache"
        computed = sorted(length - hit for hit in served[cached])
        print(
            f"{label}: TTFT {spread([1 / r for r in rates], 1e3)} ms, "
            f"prompt tokens computed {computed[len(computed) // 2]} of {length}"
        )
    print(
        f"model: demo ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters) on "
        f"{args.device}, {torch.get_num_threads()} torch threads, page size {args.page_size}"
    )
    met = paired.median_ratio >= TARGET_SPEEDUP
    print(
        f"speedup without/with: {paired.ratio_summary()} (target {TARGET_SPEEDUP:.0f}x): "
        f"{verdict(met)}"
    )
    return finish(met)


if __name__ == "__main__":
    raise SystemExit(main())
