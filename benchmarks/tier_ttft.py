"""Time to first token when a prefix is recomputed, hit on the device, or loaded from the host
or disk tier, for 1K- and 4K-token prefixes (4,064 tokens: with the question, the demo model's
whole context).

One engine with the agent's defaults (1,024 pages of 16 tokens, chunked prefill at 256 tokens
a step) plus a host tier and a disk tier in a temporary directory. Each measured request is a
prefix of its own (random tokens, never seen before in the run) plus a 16-token question,
generating one token; TTFT is the wall time from `add_request` to the step that returns it.
Before the measurement the prefix is put where the mode wants it:

- recompute: nowhere (the request computes every token);
- device: computed once by an unmeasured request, so its pages sit in the device's cache;
- host: computed, then the device cache is emptied (`PrefixCache.clear`, whose evictions store
  the pages into the host tier);
- disk: as host, then the host tier is resized to 0 and back (its pages go down to disk).

Rounds interleave the four modes (the order rotates each round); ratios are taken within a
round: recompute / tier TTFT is the speedup a tier gives, tier / device what it costs against a
device hit. `--model 135m` uses SmolLM-135M's shapes (random weights, 30 layers, 720 KiB pages).

    python benchmarks/tier_ttft.py [--model demo|135m] [--prefix-tokens 1024 4064] [--rounds 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile

import torch
from model_shapes import MODELS, benchmark_model
from paired import MIN_ROUNDS, command_line, environment, load_average, spread
from prefix_ttft import ONE_TOKEN, time_to_first_token

from kvctl.agent.runtime import Engine, EngineConfig
from kvctl.agent.startup.wiring import default_torch_threads

MODES = ("recompute", "device", "host", "disk")
QUESTION = 16


def place(engine: Engine, mode: str, prefix: list[int]) -> None:
    """Put `prefix`'s pages where `mode` reads them from."""
    if mode == "recompute":
        return
    engine.generate([prefix], ONE_TOKEN)
    if mode == "device":
        return
    assert engine.prefix_cache is not None and engine.tiers is not None
    engine.prefix_cache.clear()
    if mode == "disk":
        host = engine.tiers.tier("host")
        size = host.index.capacity * host.page_bytes
        engine.tiers.resize("host", 0)
        engine.tiers.resize("host", size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="demo")
    parser.add_argument("--prefix-tokens", type=int, nargs="+", default=[1024, 4064])
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    args = parser.parse_args(argv)
    torch.set_num_threads(default_torch_threads())
    model_config, model, _ = benchmark_model(args.model)
    vocab = model_config.vocab_size
    rng = random.Random(0)
    longest = max(args.prefix_tokens) + QUESTION
    with tempfile.TemporaryDirectory() as disk:
        engine = Engine(
            model,
            None,
            EngineConfig(
                pool_pages=max(1024, 2 * longest // 16),
                segment_pages=128,
                host_tier_bytes=4 << 30,
                disk_tier_path=disk,
                disk_tier_bytes=16 << 30,
            ),
        )
        page_mib = engine.storage.bytes_per_page / (1 << 20)
        print(environment())
        print(command_line())
        print(f"# {args.model} model, {page_mib:.3f} MiB pages, {args.rounds} rounds per size")
        engine.generate([[rng.randrange(vocab) for _ in range(64)]], ONE_TOKEN)  # warm-up
        for size in args.prefix_tokens:
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for r in range(args.rounds):
                order = MODES[r % 4 :] + MODES[: r % 4]
                for mode in order:
                    prefix = [rng.randrange(vocab) for _ in range(size)]
                    place(engine, mode, prefix)
                    question = [rng.randrange(vocab) for _ in range(QUESTION)]
                    seconds, cached = time_to_first_token(engine, prefix + question)
                    expected = 0 if mode == "recompute" else size
                    assert cached == expected, (mode, cached, expected)
                    times[mode].append(seconds)
            print(f"prefix {size} tokens: TTFT ms, median (min-max) of {args.rounds} rounds")
            for mode in MODES:
                print(f"  {mode:9s} {spread(times[mode], 1000, '.1f')}")
            for mode in ("host", "disk"):
                speedup = [a / b for a, b in zip(times["recompute"], times[mode], strict=True)]
                cost = [a / b for a, b in zip(times[mode], times["device"], strict=True)]
                print(
                    f"  {mode} hit: {statistics.median(speedup):.2f}x faster than recompute "
                    f"({min(speedup):.2f}-{max(speedup):.2f}), "
                    f"{statistics.median(cost):.2f}x a device hit ({min(cost):.2f}-{max(cost):.2f})"
                )
    print(load_average())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
