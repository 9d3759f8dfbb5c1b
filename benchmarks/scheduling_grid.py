"""Scheduling policies over a grid of workload shapes, in one engine process: the figures the
agent's default policy is chosen by.

Each grid row is a closed loop of `concurrency` clients, each sending its next request as soon
as its last one finished (as `vllm bench serve --max-concurrency` does), until `prompts`
requests have been sent: random prompts of `prompt` tokens (`±spread`, uniform, as vLLM's
`--random-range-ratio`; `prefix` tokens of them shared by every request of the row), `output`
tokens generated each (greedy, the end-of-text token ignored). The engine is stepped directly, so
HTTP and detokenizing are left out and only the scheduling differs between the policies:

- `vllm`: a token budget per step (2,048), running requests' decode tokens first, prompt chunks
  filling the rest (vLLM V1's policy, and its CPU default budget);
- `cap32`, `cap128`, `cap512`: the same, but a long prompt (more than 512 tokens to compute)
  takes at most 32 (128, 512) tokens of a step while other requests decode: a smaller
  inter-token gap, paid for by the long prompts' first tokens;
- `budget512`: the vLLM policy with a budget of 512 tokens a step.

Per row and policy it prints output tokens/s, median time to first token, median time per output
token (per request: from its first token to its last, over the tokens after the first), p99 of
the gaps between a request's tokens, and each as a ratio to the `vllm` policy in the same round.
Rounds rotate the policies' order; figures are the median over rounds with min-max.

    python benchmarks/scheduling_grid.py [--rows all|NAME,...] [--policies vllm,cap32,...]
        [--dtype float32|bfloat16] [--rounds 2] [--threads N]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from dataclasses import dataclass

import torch
from model_shapes import smollm_135m_shape
from paired import command_line, environment, spread

from kvctl.agent.model import LlamaModel, SamplingParams, build_demo_model
from kvctl.agent.runtime import Engine, EngineConfig
from kvctl.agent.startup.wiring import default_torch_threads
from kvctl.settings import DefragSettings


@dataclass(frozen=True)
class Row:
    """One workload shape."""

    name: str
    prompt: int
    output: int
    concurrency: int
    prompts: int
    spread: float = 0.0  # prompt and output lengths drawn from (1 ± spread) x their mean
    prefix: int = 0  # leading prompt tokens every request of the row shares


ROWS = (
    Row("p256-o128-c8", 256, 128, 8, 16),
    Row("p1024-o128-c16", 1024, 128, 16, 32),
    Row("p512±80%-o256±80%-c16", 512, 256, 16, 32, spread=0.8),
    Row("p128-o16-c64", 128, 16, 64, 128),
    Row("p128-o256-c64", 128, 256, 64, 64),
    Row("p1024-o256-c1", 1024, 256, 1, 2),
    Row("p1024-o256-c8", 1024, 256, 8, 16),
    Row("p4096-o16-c8", 4096, 16, 8, 8),
    Row("p4096-o256-c8", 4096, 256, 8, 8),
    Row("p128-o1024-c8", 128, 1024, 8, 8),
    Row("prefix1024+64-o128-c8", 1088, 128, 8, 16, prefix=1024),
)


@dataclass(frozen=True)
class Policy:
    """Engine settings of one scheduling policy."""

    name: str
    budget: int
    cap: int  # prompt tokens a step for long prompts while others decode; 0: no cap


POLICIES = {
    p.name: p
    for p in (
        Policy("vllm", 2048, 0),
        Policy("cap32", 2048, 32),
        Policy("cap128", 2048, 128),
        Policy("cap512", 2048, 512),
        Policy("budget512", 512, 0),
    )
}


@dataclass(frozen=True)
class Result:
    tokens_per_s: float
    ttft: float  # median, s
    tpot: float  # median, s
    itl_p99: float  # s


def lengths(row: Row, rng: random.Random) -> tuple[int, int]:
    """A request's prompt and output lengths (uniform within the row's spread)."""
    if not row.spread:
        return row.prompt, row.output
    low, high = 1 - row.spread, 1 + row.spread
    prompt = max(row.prefix + 1, round(row.prompt * rng.uniform(low, high)))
    return prompt, max(1, round(row.output * rng.uniform(low, high)))


def run_row(engine: Engine, row: Row, vocab: int, seed: int) -> Result:
    """The closed loop of one row; every request's token times."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(row.prefix)]
    sent: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    outputs = 0
    started = time.perf_counter()

    def send() -> None:
        prompt, output = lengths(row, rng)
        tokens = shared + [rng.randrange(3, vocab) for _ in range(prompt - len(shared))]
        params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
        request = engine.add_request(tokens, params)
        sent[request.request_id] = time.perf_counter()
        times[request.request_id] = []

    for _ in range(min(row.concurrency, row.prompts)):
        send()
    while engine.has_work():
        events = engine.step()
        now = time.perf_counter()
        for event in events:
            if event.token_id is not None:
                times[event.request_id].append(now)
                outputs += 1
            if event.finish_reason is not None and len(sent) < row.prompts:
                send()
    wall = time.perf_counter() - started
    ttfts = [t[0] - sent[r] for r, t in times.items()]
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    gaps = sorted(b - a for t in times.values() for a, b in itertools.pairwise(t))
    p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0
    return Result(
        outputs / wall,
        statistics.median(ttfts),
        statistics.median(tpots) if tpots else 0.0,
        p99,
    )


def make_engine(model: LlamaModel, policy: Policy, pages: int) -> Engine:
    return Engine(
        model,
        None,
        EngineConfig(
            pool_pages=pages,
            segment_pages=256,
            max_batched_tokens=policy.budget,
            max_batch_seqs=64,
            max_prefill_while_decoding=policy.cap,
            defrag=DefragSettings(enabled=False),
            prefix_cache=True,
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="all")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pages", type=int, default=4096, help="pool pages of 16 tokens")
    parser.add_argument("--threads", type=int, default=default_torch_threads())
    args = parser.parse_args(argv)
    rows = ROWS if args.rows == "all" else [r for r in ROWS if r.name in args.rows.split(",")]
    policies = [POLICIES[name] for name in args.policies.split(",")]
    if not rows:
        parser.error(f"--rows: none of {args.rows!r}; rows are {', '.join(r.name for r in ROWS)}")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config, model, _ = build_demo_model("cpu", dtype, seed=0, config=smollm_135m_shape())
    print(command_line())
    print(environment())
    print(f"model: SmolLM-135M shape, {args.dtype}, {args.pages} pages of 16 tokens")
    run_row(make_engine(model, policies[0], args.pages), Row("warm", 256, 8, 4, 4), 100, 99)
    print(
        "row | policy | output tok/s | median TTFT ms | median TPOT ms | p99 ITL ms | "
        "÷ vllm: tok/s, TTFT, TPOT, p99 ITL"
    )
    for row in rows:
        results: dict[str, list[Result]] = {p.name: [] for p in policies}
        for index in range(args.rounds):
            order = policies[index % len(policies) :] + policies[: index % len(policies)]
            for policy in order:
                engine = make_engine(model, policy, args.pages)  # a cold prefix cache each
                results[policy.name].append(run_row(engine, row, config.vocab_size, seed=index))
                del engine
        report(row, results)
    return 0


def report(row: Row, results: dict[str, list[Result]]) -> None:
    base = results.get("vllm")
    for name, runs in results.items():
        fields = ("tokens_per_s", "ttft", "tpot", "itl_p99")
        figures = [
            spread([r.tokens_per_s for r in runs], 1, ".1f"),
            *(spread([getattr(r, f) for r in runs], 1e3, ".0f") for f in fields[1:]),
        ]
        ratios = ""
        if base is not None and name != "vllm":
            ratios = ", ".join(
                spread(
                    [getattr(r, f) / getattr(b, f) for r, b in zip(runs, base, strict=True)],
                    1,
                    ".2f",
                )
                + "x"
                for f in fields
            )
        print(f"{row.name} | {name} | {' | '.join(figures)} | {ratios}")


if __name__ == "__main__":
    raise SystemExit(main())
