"""The sampler and the logits processing against transformers' own processors on the same logits:
`TemperatureLogitsWarper`, `MinPLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper` (in vLLM's
order: temperature, min-p, top-k, top-p), then `TypicalLogitsWarper`, for what a sampled row keeps
and how often it draws each token; `RepetitionPenaltyLogitsProcessor` over prompt and output, with
OpenAI's presence and frequency penalties, `logit_bias`, `allowed_token_ids` and `min_tokens`, for
a whole batch step after step while requests come, finish and are replaced (the per-request counts
are updated with each new token, never recounted)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
import torch

from kvctl.agent.model import Sampler, SamplingParams
from kvctl.agent.model.processing import RequestRows, process_logits

transformers = pytest.importorskip("transformers")

VOCAB = 60
DRAWS = 20_000
EOS = (2,)


def warped(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers in vLLM's order, on a [1, vocab] row: the probabilities sampled."""
    chain = [transformers.TemperatureLogitsWarper(params.temperature)]
    if params.min_p:
        chain.append(transformers.MinPLogitsWarper(params.min_p))
    if params.top_k > 0:
        chain.append(transformers.TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        chain.append(transformers.TopPLogitsWarper(params.top_p))
    if params.typical_p < 1:
        chain.append(transformers.TypicalLogitsWarper(params.typical_p))
    scores, ids = logits.clone(), torch.zeros(1, 1, dtype=torch.long)
    for warper in chain:
        scores = warper(ids, scores)
    return scores.softmax(dim=-1)[0]


SETTINGS = [
    {"temperature": 0.7},
    {"temperature": 1.3, "min_p": 0.1},
    {"temperature": 0.9, "top_k": 5},
    {"temperature": 1.0, "top_k": 12, "min_p": 0.2},
    {"temperature": 0.8, "top_p": 0.8},
    {"temperature": 1.2, "top_p": 0.9, "top_k": 10, "min_p": 0.05},
    {"temperature": 2.0, "top_p": 0.6, "min_p": 0.3},
    {"temperature": 1.0, "typical_p": 0.5},
    {"temperature": 1.4, "top_k": 20, "typical_p": 0.7},
    {"temperature": 0.9, "top_p": 0.95, "min_p": 0.02, "typical_p": 0.8},
]


@pytest.mark.parametrize(
    "settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items())
)
def test_a_row_draws_what_transformers_warpers_keep_in_their_proportions(settings):
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(seed=0, **settings)
    expected = warped(logits, params)
    kept = set(expected.nonzero().flatten().tolist())
    assert len(kept) > 2, "the settings should leave a choice"
    assert len(kept) < VOCAB or settings.keys() == {"temperature"}, "and truncate"
    generator = params.make_generator()
    tokens = Sampler()(logits.expand(DRAWS, VOCAB), [params] * DRAWS, [generator] * DRAWS)
    drawn = set(tokens.tolist())
    assert drawn <= kept
    assert {t for t in kept if expected[t] > 2e-3} <= drawn
    frequencies = torch.bincount(tokens, minlength=VOCAB).float() / DRAWS
    torch.testing.assert_close(frequencies, expected, atol=0.012, rtol=0)


def test_typical_p_keeps_the_tokens_nearest_the_entropy_not_the_likeliest():
    """Typical sampling can drop the most likely token when its surprise is far below the
    entropy: transformers' warper does, and so does the sampler, in a batch beside rows that
    do not ask for it (which keep every token)."""
    logits = torch.tensor([[4.0] + [1.0] * 30])
    params = SamplingParams(temperature=1.0, typical_p=0.3, seed=4)
    assert warped(logits, params)[0] == 0
    plain = SamplingParams(temperature=1.0, seed=5)
    rows = [params] * 2000 + [plain] * 2000
    generators = [params.make_generator()] * 2000 + [plain.make_generator()] * 2000
    tokens = Sampler()(logits.expand(4000, 31), rows, generators)
    assert 0 not in tokens[:2000].tolist()
    assert 0 in tokens[2000:].tolist()


def test_top_p_after_min_p_is_vllms_order():
    """vLLM runs min-p before top-p, so top-p counts only the mass min-p left; transformers'
    generate runs top-p first. Here the orders differ by one token, and the sampler keeps
    vLLM's set."""
    logits = torch.tensor([[1.0, 0.9, 0.8, 0.7, 0.6] + [-5.0] * 50])
    params = SamplingParams(temperature=1.0, top_p=0.83, min_p=0.3, seed=1)
    assert set(warped(logits, params).nonzero().flatten().tolist()) == {0, 1, 2, 3}
    ids = torch.zeros(1, 1, dtype=torch.long)
    top_p_first = transformers.TopPLogitsWarper(0.83)(ids, logits.clone())
    top_p_first = transformers.MinPLogitsWarper(0.3)(ids, top_p_first)
    assert set(top_p_first.isfinite().nonzero()[:, 1].tolist()) == {0, 1, 2, 3, 4}
    generator = params.make_generator()
    tokens = Sampler()(logits.expand(4000, 55), [params] * 4000, [generator] * 4000)
    assert set(tokens.tolist()) == {0, 1, 2, 3}


# ---- logits processing over a batch, step after step --------------------------------------


@dataclass(eq=False)
class Running:
    """What processing reads of a request (the engine's `Request` has the same fields)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False


def reference(logits: torch.Tensor, request: Running) -> torch.Tensor:
    """One row processed in vLLM's order with transformers' processors where it has them."""
    p, row = request.params, logits.clone()
    if p.allowed_token_ids:
        blocked = torch.ones(VOCAB, dtype=torch.bool)
        blocked[list(p.allowed_token_ids)] = False
        row[blocked] = -math.inf
    if len(request.output_ids) < p.min_tokens:
        row[[*(p.stop_token_ids or ()), *([] if p.ignore_eos else EOS)]] = -math.inf
    if p.logit_bias:
        bias = transformers.SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in p.bias])
        row = bias(torch.tensor([[0]]), row[None])[0]
    if p.repetition_penalty != 1:
        penalty = transformers.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
        ids = torch.tensor([request.prompt_ids + request.output_ids])
        row = penalty(ids, row[None])[0]
    counts = torch.bincount(torch.tensor(request.output_ids, dtype=torch.long), minlength=VOCAB)
    counts = counts.float()
    return row - counts * p.frequency_penalty - (counts > 0).float() * p.presence_penalty


def random_params(rng: random.Random) -> SamplingParams:
    choice = rng.randrange(8)
    bias = {str(t): rng.uniform(-5, 5) for t in rng.sample(range(VOCAB), rng.randrange(1, 6))}
    return SamplingParams(
        temperature=rng.choice([0.0, 0.8]),
        max_tokens=64,
        repetition_penalty=rng.choice([1.0, 1.3, 0.7]) if choice in (0, 1, 5) else 1.0,
        presence_penalty=rng.choice([0.0, 1.5]) if choice in (1, 2, 5) else 0.0,
        frequency_penalty=rng.choice([0.0, -0.4, 0.9]) if choice in (2, 5) else 0.0,
        logit_bias=bias if choice in (3, 5) else None,
        allowed_token_ids=rng.sample(range(VOCAB), 20) if choice == 4 else None,
        min_tokens=rng.choice([0, 3]) if choice in (4, 6) else 0,
        stop_token_ids=[7] if choice == 6 else None,
        ignore_eos=choice == 6 and rng.random() < 0.5,
    )


def new_request(rng: random.Random) -> Running:
    return Running(random_params(rng), rng.choices(range(VOCAB), k=rng.randrange(1, 30)))


def test_a_batch_is_processed_as_each_row_would_be_alone_step_after_step():
    """Requests of every kind (and some with nothing to process) run in one batch for 40 steps;
    some finish, some are dropped without finishing, new ones take their place and their rows,
    and one sits out steps and comes back with tokens it has not been seen with. Every step,
    every row equals transformers' processing of that row alone."""
    rng = random.Random(5)
    rows = RequestRows()
    running = [new_request(rng) for _ in range(6)]
    away: list[Running] = []
    done: list[Running] = []  # finished, and still referenced (as an answer may hold one)
    for step in range(40):
        logits = 3 * torch.randn(len(running), VOCAB, generator=torch.Generator().manual_seed(step))
        raw = logits.clone()
        processed = process_logits(logits, running, EOS, rows)
        for i, request in enumerate(running):
            expected = reference(logits[i], request)
            torch.testing.assert_close(processed[i], expected, atol=1e-5, rtol=0)
        assert torch.equal(logits, raw), "the raw logits stay as they were (logprobs read them)"
        for request in running + away:
            request.output_ids.append(rng.randrange(VOCAB))
        if step % 5 == 4:
            running[0].finished = True
            done.append(running.pop(0))
        if step % 7 == 6:
            running.pop(rng.randrange(len(running)))  # aborted: dropped without finishing
        if step % 9 == 3:
            away.append(running.pop(rng.randrange(len(running))))
        elif away and step % 9 == 6:
            running.append(away.pop())
        while len(running) < 6:
            running.append(new_request(rng))
    assert rows.capacity == 8, "rows of finished and dropped requests are reused"


def test_nothing_to_process_returns_the_logits_themselves():
    logits = torch.randn(3, VOCAB)
    requests = [Running(SamplingParams(temperature=0), [1, 2]) for _ in range(3)]
    assert process_logits(logits, requests, EOS, RequestRows()) is logits
