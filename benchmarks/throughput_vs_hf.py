"""Output tokens per second: the engine (agent defaults: continuous batching, chunked prefill,
prefix cache) against transformers' static-batch `generate`, same weights, fp32 on the CPU.

`--model demo` (3.2 M parameters) or `135m` (SmolLM-135M's shape: hidden 576, 30 layers, 9 heads,
3 KV heads, head dim 64, intermediate 1536, vocabulary 49152, tied embeddings; random weights from
a fixed seed). The weights are loaded into a transformers `LlamaForCausalLM` (the parameter names
are Hugging Face's), and one greedy prompt is checked to give the same tokens on both sides. Both
sides run with the same torch thread count, by default the agent's (cores - 1).
Two workloads, each at `--concurrency` requests submitted at once:

- uniform: every prompt `--prompt-tokens` long, every request `--new-tokens` new tokens;
- chat: a shared `--system-tokens` system prompt, then a user turn of 16-96 tokens and an output
  of 16-128 tokens, drawn per request. The static batch is left-padded and generates until its
  longest output; only each request's own tokens count. The engine serves rounds as a running
  server does: the system prompt stays in its prefix cache from one round to the next.

EOS is ignored on both sides, so both produce exactly the requested tokens. Rounds are paired and
interleaved (engine, transformers, transformers, engine, ...): tokens/s are the median (min-max)
over rounds, the ratio the median (min-max) of per-round ratios.

    python benchmarks/throughput_vs_hf.py [--model demo|135m] [--concurrency 8 32]
        [--workload uniform chat] [--rounds 7] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch
from model_shapes import benchmark_model
from paired import (
    MIN_ROUNDS,
    command_line,
    environment,
    finish,
    paired_rounds,
    spread,
    verdict,
)

from kvctl.agent.model import SamplingParams
from kvctl.agent.runtime import Engine, EngineConfig
from kvctl.agent.startup.wiring import default_torch_threads

TARGET = 1.3


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    new_tokens: int


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """A transformers Llama holding `model`'s weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        attn_implementation="sdpa",
    )
    hf = LlamaForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if c.tie_word_embeddings else set()
    assert not unexpected and all("rotary" in k or k in tied for k in missing), missing
    if tied:
        hf.tie_weights()
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf


def workload(kind: str, n: int, args: argparse.Namespace, rng: random.Random) -> list[Job]:
    def tokens(count: int) -> list[int]:
        return [rng.randrange(32, 127) for _ in range(count)]

    if kind == "uniform":
        return [Job(tokens(args.prompt_tokens), args.new_tokens) for _ in range(n)]
    system = random.Random(args.seed).choices(range(32, 127), k=args.system_tokens)
    return [Job(system + tokens(rng.randint(16, 96)), rng.randint(16, 128)) for _ in range(n)]


def run_engine(engine: Engine, jobs: list[Job]) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    requests = [
        engine.add_request(
            j.prompt, SamplingParams(temperature=0, max_tokens=j.new_tokens, ignore_eos=True)
        )
        for j in jobs
    ]
    while engine.has_work():
        engine.step()
    elapsed = time.perf_counter() - started
    return sum(len(r.output_ids) for r in requests) / elapsed, [r.output_ids for r in requests]


@torch.inference_mode()
def run_hf(hf: torch.nn.Module, jobs: list[Job]) -> tuple[float, list[list[int]]]:
    """One static batch: left-padded prompts, generating until the longest output."""
    width = max(len(j.prompt) for j in jobs)
    ids = torch.zeros(len(jobs), width, dtype=torch.long)
    mask = torch.zeros(len(jobs), width, dtype=torch.long)
    for i, j in enumerate(jobs):
        ids[i, width - len(j.prompt) :] = torch.tensor(j.prompt)
        mask[i, width - len(j.prompt) :] = 1
    started = time.perf_counter()
    out = hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max(j.new_tokens for j in jobs),
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    elapsed = time.perf_counter() - started
    outputs = [out[i, width : width + j.new_tokens].tolist() for i, j in enumerate(jobs)]
    return sum(j.new_tokens for j in jobs) / elapsed, outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["demo", "135m"], default="demo")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--workload", nargs="+", default=["uniform", "chat"])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=default_torch_threads())
    args = parser.parse_args(argv)
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}: fewer pairs say little")
    torch.set_num_threads(args.threads)
    print(command_line())
    print(environment())
    print(
        f"# both sides: {args.threads} torch threads (the agent's default here: "
        f"{default_torch_threads()}); model {args.model}"
    )
    _, model, tokenizer = benchmark_model(args.model)
    hf = hf_model(model)
    check = Job([65, 66, 67, 68, 69], 12)
    probe = Engine(model, tokenizer, EngineConfig(pool_pages=64, segment_pages=64))
    assert run_engine(probe, [check])[1] == run_hf(hf, [check])[1], "the two sides disagree"
    rng = random.Random(args.seed)
    met = True
    for kind in args.workload:
        for n in args.concurrency:
            engine = Engine(model, tokenizer, EngineConfig(pool_pages=1024, segment_pages=128))
            run_engine(engine, workload(kind, n, args, rng))  # warm-up (and a cached system)
            run_hf(hf, workload(kind, min(n, 4), args, rng))
            paired = paired_rounds(
                lambda: run_engine(engine, workload(kind, n, args, rng))[0],  # noqa: B023
                lambda: run_hf(hf, workload(kind, n, args, rng))[0],  # noqa: B023
                args.rounds,
            )
            ok = paired.median_ratio >= TARGET
            met &= ok
            print(
                f"{kind:>7} x{n:<3} engine {spread(paired.ours, 1, '.0f')} tok/s, transformers "
                f"{spread(paired.base, 1, '.0f')} tok/s: {paired.ratio_summary()} "
                f"(target {TARGET}x: {verdict(ok)})"
            )
    return finish(met)


if __name__ == "__main__":
    raise SystemExit(main())
