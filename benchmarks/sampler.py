"""The engine's choice of one step's tokens: batched sampling and logits processing against the
previous per-row implementation.

What is timed is what `Engine._choose` does for one decode step of B requests, no
log-probabilities asked: `process_logits` on [B, vocab] float32 logits, the sampler, and the copy
of the chosen tokens to the host. The baseline is the previous implementation, copied below as it
was: it sorted the whole vocabulary of every sampled row even without top-k or top-p, drew each
row's noise from the row's own generator in a Python loop (a request without a seed had a
randomly seeded one), and applied penalties with a few torch ops per row, counting each row's
output again every step.

Cases, each at every `--batch` (vocabulary 49,152, SmolLM2's):

- greedy: temperature 0;
- temperature: temperature 1.0 and no seed (what `vllm bench serve` sends by default);
- top-k: top_k 50 alone;
- top-k/top-p: top_k 50 and top_p 0.95 (top-p among the 50);
- top-p: top_p 0.95 alone (the one case that sorts the vocabulary);
- seeded: temperature 0.8 and a seed per request;
- penalised: temperature 1.0, presence 0.5 and frequency 0.3 (what both sides implement), over
  prompts of 512 tokens and outputs that start at 256 tokens.

A measurement runs `--steps` steps of fresh requests, each step appending the chosen token to
every output (the penalised case's counts grow as in decoding; the batched side fills each
request's rows on its first step, which the measurement includes). Rounds are paired and
interleaved (paired.py); figures are the median (min-max) over rounds of ms per step, and the
ratio previous / batched is taken within each round. Greedy rows, penalised or not, are checked
to choose the same tokens on both sides first.

    python benchmarks/sampler.py [--batch 8 32] [--vocab 49152] [--steps 10] [--rounds 7]
        [--device cpu] [--case greedy temperature ...]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from paired import MIN_ROUNDS, Paired, command_line, environment, paired_rounds, spread
from torch import Tensor

from kvctl.agent.model.processing import process_logits
from kvctl.agent.model.sampling import Sampler, SamplingParams

EOS = frozenset({2})
PROMPT_TOKENS, OUTPUT_TOKENS = 512, 256

CASES: dict[str, dict[str, object]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 1.0},
    "top-k": {"temperature": 1.0, "top_k": 50},
    "top-k/top-p": {"temperature": 1.0, "top_k": 50, "top_p": 0.95},
    "top-p": {"temperature": 1.0, "top_p": 0.95},
    "seeded": {"temperature": 0.8, "seed": 0},
    "penalised": {"temperature": 1.0, "presence_penalty": 0.5, "frequency_penalty": 0.3},
}


# ---- the previous implementation, as it was -------------------------------------------------


def previous_generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """The previous `make_generator`: every sampled request had its own generator."""
    if params.greedy:
        return None
    generator = torch.Generator()
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed + index)
    return generator


def previous_process_logits(
    logits: Tensor,
    params: Sequence[SamplingParams],
    outputs: Sequence[Sequence[int]],
    eos_token_ids: frozenset[int],
) -> Tensor:
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    logits = logits.float().clone()
    vocab, device = logits.shape[-1], logits.device
    for i in rows:
        p, row = params[i], logits[i]
        if p.bias:
            ids = torch.tensor([t for t, _ in p.bias], device=device)
            row.index_add_(0, ids, torch.tensor([b for _, b in p.bias], device=device))
        if (p.presence_penalty or p.frequency_penalty) and outputs[i]:
            ids = torch.tensor(list(outputs[i]), device=device)
            counts = torch.bincount(ids, minlength=vocab)[:vocab].to(row.dtype)
            row -= counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty
        if len(outputs[i]) < p.min_tokens:
            enders = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos_token_ids))
            if enders:
                row[torch.tensor(sorted(enders), device=device)] = -math.inf
    return logits


def previous_sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> Tensor:
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        picked = previous_sample_rows(
            logits.index_select(0, index),
            [params[i] for i in rows],
            [generators[i] for i in rows],
        )
        tokens[index] = picked
    return tokens


def previous_sample_rows(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> Tensor:
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=device)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    sorted_logits, order = (logits.float() / temperature[:, None]).sort(
        dim=-1, descending=True, stable=True
    )
    ranks = torch.arange(vocab, device=device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], -math.inf)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before > top_p[:, None], 0.0)
    noise = torch.stack([previous_exponential(vocab, g, device) for g in generators])
    choice = (probs / noise).argmax(dim=-1, keepdim=True)
    return order.gather(1, choice).squeeze(1)


def previous_exponential(n: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    noise = torch.empty(n, device=device).exponential_(generator=generator)
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


# ---- the two sides ------------------------------------------------------------------------


@dataclass(eq=False)
class Running:
    """A request as processing reads it (the engine's `Request` has these fields)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    finished: bool = False


Side = Callable[[Tensor, list[Running]], list[int]]


def batched_side() -> Side:
    """What `Engine._choose` does now; one sampler (and its rows) per engine."""
    sampler = Sampler()

    def choose(logits: Tensor, requests: list[Running]) -> list[int]:
        processed = process_logits(logits, requests, EOS, sampler.rows)
        params = [r.params for r in requests]
        return sampler(processed, params, [r.generator for r in requests]).tolist()

    return choose


def previous_side(logits: Tensor, requests: list[Running]) -> list[int]:
    params = [r.params for r in requests]
    outputs = [r.output_ids for r in requests]
    processed = previous_process_logits(logits, params, outputs, EOS)
    return previous_sample(processed, params, [r.generator for r in requests]).tolist()


def requests_for(
    settings: dict[str, object], batch: int, vocab: int, batched: bool, device: torch.device
) -> list[Running]:
    """`batch` fresh requests with these settings (a seed each where they have one), with the
    generators each side gives them."""
    rng = torch.Generator().manual_seed(batch)
    requests = []
    for i in range(batch):
        mine = {**settings, "seed": i} if "seed" in settings else settings
        params = SamplingParams(max_tokens=4096, **mine)  # type: ignore[arg-type]  # mixed-type settings
        generator = params.make_generator(device) if batched else previous_generator(params, i)
        requests.append(
            Running(
                params,
                torch.randint(0, vocab, (PROMPT_TOKENS,), generator=rng).tolist(),
                torch.randint(0, vocab, (OUTPUT_TOKENS,), generator=rng).tolist(),
                generator,
            )
        )
    return requests


def run_steps(
    side: Side, requests: list[Running], logits: Sequence[Tensor], device: torch.device
) -> tuple[float, list[list[int]]]:
    """Seconds per step over the steps, and the tokens chosen at each."""
    chosen = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for step_logits in logits:
        tokens = side(step_logits, requests)
        for request, token in zip(requests, tokens, strict=True):
            request.output_ids.append(token)
        chosen.append(tokens)
    return (time.perf_counter() - start) / len(logits), chosen


def check_same_greedy_tokens(logits: Sequence[Tensor], vocab: int, device: torch.device) -> None:
    """Greedy rows, with and without penalties, choose the same tokens on both sides."""
    batch = logits[0].shape[0]
    for settings in (CASES["greedy"], {**CASES["penalised"], "temperature": 0.0}):
        ours = requests_for(settings, batch, vocab, True, device)
        base = requests_for(settings, batch, vocab, False, device)
        chosen = run_steps(batched_side(), ours, logits, device)[1]
        assert chosen == run_steps(previous_side, base, logits, device)[1], settings


def measure(
    case: str, logits: Sequence[Tensor], vocab: int, device: torch.device, rounds: int
) -> Paired:
    """Paired rounds of seconds per step: batched (`ours`) and previous (`base`)."""
    batch = logits[0].shape[0]

    def ours() -> float:
        requests = requests_for(CASES[case], batch, vocab, True, device)
        return run_steps(batched_side(), requests, logits, device)[0]

    def base() -> float:
        requests = requests_for(CASES[case], batch, vocab, False, device)
        return run_steps(previous_side, requests, logits, device)[0]

    ours(), base()  # warm-up
    return paired_rounds(ours, base, rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--case", nargs="+", choices=list(CASES), default=list(CASES))
    args = parser.parse_args(argv)
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}: fewer pairs say little")
    print(command_line())
    print(environment())
    device = torch.device(args.device)
    print(
        f"device {device}, vocabulary {args.vocab}, float32 logits, {args.steps} steps per "
        f"measurement, {args.rounds} paired rounds; ms per step, median (min-max) over rounds"
    )
    print(f"{'case':<13}{'batch':>5}  {'batched':<25}{'previous':<25}previous / batched")
    for batch in args.batch:
        generator = torch.Generator(device=device).manual_seed(batch)
        logits = [
            3 * torch.randn(batch, args.vocab, generator=generator, device=device)
            for _ in range(args.steps)
        ]
        check_same_greedy_tokens(logits, args.vocab, device)
        for case in args.case:
            result = measure(case, logits, args.vocab, device, args.rounds)
            speedups = [b / a for a, b in zip(result.ours, result.base, strict=True)]
            print(
                f"{case:<13}{batch:>5}  {spread(result.ours, 1e3):<25}"
                f"{spread(result.base, 1e3):<25}{spread(speedups)}x"
            )
    print(environment().replace("# ", "# at the end: ", 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
