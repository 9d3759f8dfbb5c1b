"""Time to first token with and without the prefix cache, on the demo model, for a shared prefix.

Each measured request is a 1,000-token shared prefix (a system prompt) plus a 16-token question of
its own, generating one token, with nothing else running. TTFT is the wall time from
`add_request` to the step that returns its token. Without the cache every request computes all
1,016 tokens. With it, a warm-up request computes the prefix once; each measured request then
adopts the cached pages and computes only its own tokens (at page size 16 the prefix ends
mid-page, 1,000 = 62 × 16 + 8, so the partly filled page is copied first).

Both engines are warmed up with one unmeasured request, run in the same process on the same
device, and the figures are medians over `--repeat` requests.

    python benchmarks/prefix_ttft.py [--prefix-tokens 1000] [--suffix-tokens 16] [--repeat 7]
        [--page-size 16] [--device cpu]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from kvctl.agent.model import SamplingParams, build_demo_model
from kvctl.agent.pool import DefragPolicy
from kvctl.agent.runtime import Engine, EngineConfig

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
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print("command: python benchmarks/prefix_ttft.py " + " ".join(sys.argv[1:]))

    _, model, tokenizer = build_demo_model(args.device, torch.float32, seed=0)
    rng = random.Random(args.seed)

    def text_tokens(n: int) -> list[int]:
        return [rng.randrange(32, 127) for _ in range(n)]  # printable bytes of the byte tokenizer

    prefix = [tokenizer.BOS, *text_tokens(args.prefix_tokens - 1)]
    prompts = [prefix + text_tokens(args.suffix_tokens) for _ in range(args.repeat + 1)]
    pages = 2 * -(-(args.prefix_tokens + args.suffix_tokens) // args.page_size) * (args.repeat + 2)
    medians = {}
    for cached in (False, True):
        config = EngineConfig(
            device=args.device,
            page_size=args.page_size,
            pool_pages=pages,
            segment_pages=pages,
            defrag=DefragPolicy(enabled=False),
            prefix_cache=cached,
        )
        engine = Engine(model, tokenizer, config)
        time_to_first_token(engine, prompts[0])  # warm-up; with the cache it also caches the prefix
        runs = [time_to_first_token(engine, p) for p in prompts[1:]]
        medians[cached] = statistics.median(seconds for seconds, _ in runs)
        served = statistics.median(hit for _, hit in runs)
        label = "with prefix cache   " if cached else "without prefix cache"
        print(
            f"{label}: TTFT {medians[cached] * 1e3:8.2f} ms (median of {args.repeat}), "
            f"prompt tokens computed {len(prompts[1]) - served:.0f} of {len(prompts[1])}"
        )
    speedup = medians[False] / medians[True]
    print(
        f"model: demo ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters) on "
        f"{args.device}, {torch.get_num_threads()} torch threads, page size {args.page_size}"
    )
    met = speedup >= TARGET_SPEEDUP
    print(
        f"speedup without/with: {speedup:.1f}x (target {TARGET_SPEEDUP:.0f}x): "
        f"{'met' if met else 'NOT met'}"
    )
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
