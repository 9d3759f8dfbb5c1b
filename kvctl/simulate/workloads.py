"""Seeded synthetic workloads: three benchmark scenarios of contiguous against paged allocation
(one model under a burst, one model with random lengths, three models sharing a device), whose
claimed figures docs/performance.md, "Against the claimed figures", sets the results against.

Every draw comes from one `random.Random(seed)`, so a seed names one workload exactly, on every
machine. A request has an arrival step, prompt tokens, the maximum output the
client allows (`max_output_tokens`, what a contiguous allocator must reserve), the output it
actually produces (`output_tokens` ≤ max) and a model.

Choices common to all scenarios (each is a modelling assumption, stated so it can be argued with):

- **Actual output length** is drawn independently of the cap, log-normal with median 256 tokens
  and σ = 1 (mean ≈ 420, 90th percentile ≈ 920), then truncated at the cap. Real answers stop at
  an end-of-sequence token long before typical limits: the vLLM paper's ShareGPT trace averages
  338 output tokens and LMSYS-Chat-1M responses are a few hundred tokens, with a long tail. The
  length of an answer is a property of the question, not of the limit, hence independent draws;
  requests whose draw exceeds the cap run to the cap (truncated answers).
- **The cap** (`max_tokens`, except in `random-lengths`, which draws prompt + cap together): half
  the clients set one (512, 1024 or 2048 tokens); the others leave it to the server, whose default
  (as in vLLM's OpenAI server) is the rest of the context window.
- **KV bytes per token** are fp16 K and V for every layer of real architectures:
  Llama-2-70B 80 layers × 8 KV heads × 128 → 320 KiB; Mistral-7B 32 × 8 × 128 → 128 KiB;
  Gemma-2B 18 × 1 × 256 → 18 KiB.
- **Budget**: the device's KV budget is `budget_fraction` × the *peak reserved demand*: the most
  bytes a contiguous allocator would hold at once if memory were unlimited (every request admitted
  on arrival, reserving prompt + cap, living one prefill step plus ⌈output ÷ decode chunk⌉ decode
  steps). Below 1 the workload must queue; the fractions are chosen so that both allocators are
  under pressure but the largest request always fits an empty device.

Scenarios:

- `high-concurrency`: 1000 requests to an 8K-context Llama-2-70B, all arriving at step 0;
  prompts uniform 1K–6K tokens. Budget 0.30 of peak demand (the burst is 3× what fits).
- `random-lengths`: 500 requests to a 16K-context Llama-2-70B, Poisson arrivals at 2 per step;
  request length (prompt + cap) uniform 1K–16K, of which the prompt takes a uniform 50–90 %.
  Budget 0.35 of peak demand.
- `multi-model`: 600 requests to three models sharing one device (Llama-2-70B, Mistral-7B,
  Gemma-2B; 8K context each), Poisson arrivals at 3 per step; prompts uniform 256–4K tokens.
  Popularity shifts in three equal phases (each model gets 60 % of its phase's requests, the others
  20 % each), so per-model memory needs rise and fall. Budget 0.25 of peak demand.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DECODE_CHUNK = 16
"""Tokens a running request decodes per simulated step (the same on both sides)."""


@dataclass(frozen=True)
class Model:
    """A model's name and the KV-cache bytes one token costs (all layers, K and V)."""

    name: str
    kv_bytes_per_token: int


LLAMA_70B = Model("llama-2-70b", 2 * 80 * 8 * 128 * 2)
MISTRAL_7B = Model("mistral-7b", 2 * 32 * 8 * 128 * 2)
GEMMA_2B = Model("gemma-2b", 2 * 18 * 1 * 256 * 2)


@dataclass(frozen=True)
class Request:
    """One request: when it arrives, how long its prompt is, what it may and does generate."""

    id: int
    arrival: int
    prompt_tokens: int
    max_output_tokens: int
    output_tokens: int
    model: str

    @property
    def reserved_tokens(self) -> int:
        """What a contiguous allocator reserves: prompt plus the largest allowed output."""
        return self.prompt_tokens + self.max_output_tokens


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order (ids ascending), the models they use and the device budget."""

    name: str
    models: tuple[Model, ...]
    requests: tuple[Request, ...]
    budget_bytes: int
    budget_fraction: float
    peak_demand_bytes: int

    def model(self, name: str) -> Model:
        return next(m for m in self.models if m.name == name)


@dataclass(frozen=True)
class Scenario:
    """A named generator with its default size and budget fraction."""

    name: str
    generate: Callable[[random.Random, int], tuple[tuple[Model, ...], list[Request]]]
    requests: int
    budget_fraction: float


def draw_output_tokens(rng: random.Random, cap: int) -> int:
    """An answer's actual length: log-normal, median 256, σ 1, truncated at the cap (see the
    module docstring); the budget scenario draws its outputs with it too."""
    return max(1, min(cap, round(rng.lognormvariate(math.log(256), 1.0))))


def draw_cap(rng: random.Random, prompt: int, context: int) -> int:
    """The client's max_tokens, or the server default: the rest of the context window (see the
    module docstring); the budget scenario draws its caps with it too."""
    room = context - prompt
    if rng.random() < 0.5:
        return min(rng.choice((512, 1024, 2048)), room)
    return room


def _poisson_arrivals(rng: random.Random, count: int, per_step: float) -> list[int]:
    """Arrival steps of a Poisson process with `per_step` arrivals per step on average."""
    t = 0.0
    steps = []
    for _ in range(count):
        t += rng.expovariate(per_step)
        steps.append(int(t))
    return steps


def _high_concurrency(rng: random.Random, count: int) -> tuple[tuple[Model, ...], list[Request]]:
    requests = []
    for i in range(count):
        prompt = rng.randint(1024, 6144)
        cap = draw_cap(rng, prompt, 8192)
        out = draw_output_tokens(rng, cap)
        requests.append(Request(i, 0, prompt, cap, out, LLAMA_70B.name))
    return (LLAMA_70B,), requests


def _random_lengths(rng: random.Random, count: int) -> tuple[tuple[Model, ...], list[Request]]:
    requests = []
    for i, arrival in enumerate(_poisson_arrivals(rng, count, 2.0)):
        length = rng.randint(1024, 16384)
        prompt = round(length * rng.uniform(0.5, 0.9))
        cap = length - prompt
        out = draw_output_tokens(rng, cap)
        requests.append(Request(i, arrival, prompt, cap, out, LLAMA_70B.name))
    return (LLAMA_70B,), requests


def _multi_model(rng: random.Random, count: int) -> tuple[tuple[Model, ...], list[Request]]:
    models = (LLAMA_70B, MISTRAL_7B, GEMMA_2B)
    requests = []
    for i, arrival in enumerate(_poisson_arrivals(rng, count, 3.0)):
        phase = min(2, 3 * i // count)
        weights = [0.6 if k == phase else 0.2 for k in range(3)]
        model = rng.choices(models, weights)[0]
        prompt = rng.randint(256, 4096)
        cap = draw_cap(rng, prompt, 8192)
        out = draw_output_tokens(rng, cap)
        requests.append(Request(i, arrival, prompt, cap, out, model.name))
    return models, requests


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("high-concurrency", _high_concurrency, 1000, 0.30),
        Scenario("random-lengths", _random_lengths, 500, 0.35),
        Scenario("multi-model", _multi_model, 600, 0.25),
    )
}


def lifetime_steps(request: Request, decode_chunk: int = DECODE_CHUNK) -> int:
    """Steps a request lives when never delayed: one prefill step plus its decode steps."""
    return 1 + -(-request.output_tokens // decode_chunk)


def peak_demand_bytes(
    requests: Sequence[Request], models: Sequence[Model], decode_chunk: int = DECODE_CHUNK
) -> int:
    """Most bytes reserved at once (prompt + cap per live request) if memory were unlimited."""
    per_token = {m.name: m.kv_bytes_per_token for m in models}
    events: list[tuple[int, int]] = []
    for r in requests:
        size = r.reserved_tokens * per_token[r.model]
        events.append((r.arrival, size))
        events.append((r.arrival + lifetime_steps(r, decode_chunk), -size))
    events.sort(key=lambda e: (e[0], e[1]))  # frees before arrivals at the same step
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def build_workload(
    name: str,
    seed: int,
    requests: int | None = None,
    budget_fraction: float | None = None,
    decode_chunk: int = DECODE_CHUNK,
) -> Workload:
    """The workload of scenario `name` for `seed`; `requests` and `budget_fraction` override."""
    try:
        scenario = SCENARIOS[name]
    except KeyError:
        choices = ", ".join(SCENARIOS)
        raise ValueError(f"unknown scenario {name!r}; choose one of {choices}") from None
    count = scenario.requests if requests is None else requests
    if count < 1:
        raise ValueError(f"requests must be at least 1, got {count}")
    fraction = scenario.budget_fraction if budget_fraction is None else budget_fraction
    if not 0 < fraction <= 1:
        raise ValueError(f"budget_fraction must be in (0, 1], got {fraction}")
    models, reqs = scenario.generate(random.Random(seed), count)
    peak = peak_demand_bytes(reqs, models, decode_chunk)
    per_token = {m.name: m.kv_bytes_per_token for m in models}
    largest = max(r.reserved_tokens * per_token[r.model] for r in reqs)
    budget = max(int(peak * fraction), 2 * largest)
    return Workload(name, models, tuple(reqs), budget, fraction, peak)
