"""Sampling: greedy, seeded reproducibility independent of the batch, truncation, validation."""

import pytest
import torch

from kvctl.agent.model import Sampler, SamplingParams

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def _sample(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return Sampler()(logits, params, [p.make_generator() for p in params])


def test_greedy_is_argmax():
    logits = _logits(6)
    assert torch.equal(_sample(logits, [SamplingParams(temperature=0)] * 6), logits.argmax(-1))


def test_same_seed_same_tokens_whatever_the_batch():
    """A seeded request draws the same tokens alone and among other requests, step after step."""
    steps = [_logits(4, seed=s) for s in range(20)]
    mine = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone_gen = [mine.make_generator()]
    others = [SamplingParams(temperature=0), SamplingParams(temperature=1.3, seed=5)]
    batch_params = [others[0], mine, others[1]]
    batch_gen = [p.make_generator() for p in batch_params]
    sampler = Sampler()
    alone = [int(sampler(step[2:3], [mine], alone_gen)[0]) for step in steps]
    batched = [int(sampler(step[[0, 2, 3]], batch_params, batch_gen)[1]) for step in steps]
    assert alone == batched
    assert len(set(alone)) > 3, "a temperature-0.9 sampler should not repeat one token"
    replay_gen = [mine.make_generator()]
    assert [int(sampler(step[2:3], [mine], replay_gen)[0]) for step in steps] == alone


def test_different_seeds_differ():
    logits = _logits(1).expand(8, VOCAB)
    tokens = _sample(logits, [SamplingParams(temperature=2.0, seed=s) for s in range(8)])
    assert len(set(tokens.tolist())) > 1


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "top_p": 0.5}])
def test_truncation_to_one_token_is_greedy(params):
    logits = _logits(16, seed=9)
    sampled = _sample(
        logits, [SamplingParams(temperature=1.5, seed=i, **params) for i in range(16)]
    )
    assert torch.equal(sampled, logits.argmax(-1))


def test_frequencies_follow_the_truncated_distribution():
    """4000 draws with top_k=3 from known logits land on the top 3 in softmax proportions."""
    logits = torch.tensor([[2.0, 1.0, 0.0, 1.5, -1.0] + [-30.0] * 5]).expand(4000, 10)
    params = SamplingParams(temperature=1.0, top_k=3, seed=0)
    generator = params.make_generator()
    tokens = Sampler()(logits, [params] * 4000, [generator] * 4000)
    counts = torch.bincount(tokens, minlength=10).float() / 4000
    expected = torch.zeros(10)
    expected[[0, 3, 1]] = torch.softmax(torch.tensor([2.0, 1.5, 1.0]), dim=0)
    torch.testing.assert_close(counts, expected, atol=0.03, rtol=0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].expand(2000, 4)
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=3)
    generator = params.make_generator()
    tokens = Sampler()(logits, [params] * 2000, [generator] * 2000)
    assert set(tokens.tolist()) == {0, 1}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.5, "temperature must be ≥ 0"),
        ("temperature", float("nan"), "temperature must be a number"),
        ("temperature", "hot", "temperature must be a number"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
        ("top_k", -2, "top_k must be an integer"),
        ("top_k", 2.5, "top_k must be an integer"),
        ("seed", 2**64, "seed must be an integer"),
        ("seed", True, "seed must be an integer"),
        ("max_tokens", 0, "max_tokens must be an integer ≥ 1"),
        ("stop", ["ok", ""], "stop must be a list of non-empty strings"),
        ("ignore_eos", "yes", "ignore_eos must be true or false"),
    ],
)
def test_bad_params_raise_with_a_clear_message(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_defaults_and_stop_normalisation():
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (1.0, 1.0, 0, 16)
    assert params.seed is None and params.stop == () and not params.ignore_eos
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(temperature=0).make_generator() is None
