"""Sampling: greedy, seeded reproducibility independent of the batch (for every kind of row),
truncation, validation. Equivalence with transformers' warpers: test_sampling_hf.py."""

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


MINE = [
    {"temperature": 0.9, "top_p": 0.95},
    {"temperature": 0.9},
    {"temperature": 1.1, "min_p": 0.05},
    {"temperature": 0.8, "top_k": 7},
    {"temperature": 1.0, "top_k": 9, "min_p": 0.02, "top_p": 0.97},
]
OTHERS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.3, seed=5),
    SamplingParams(temperature=1.0),  # no seed: the sampler's own generator
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.2, top_k=20, seed=8),
    SamplingParams(temperature=0.6, top_p=0.5),
    SamplingParams(temperature=1.0, min_p=0.3),
]


@pytest.mark.parametrize("settings", MINE, ids=lambda s: ",".join(s))
def test_same_seed_same_tokens_whatever_the_batch(settings):
    """A seeded request draws the same tokens alone and among requests of every kind (greedy,
    seeded, unseeded, top-k, top-p, min-p), step after step, wherever it sits in the batch."""
    steps = [_logits(len(OTHERS) + 1, seed=s) for s in range(20)]
    mine = SamplingParams(seed=1234, **settings)
    sampler = Sampler()
    alone_gen = [mine.make_generator()]
    alone = [int(sampler(step[-1:], [mine], alone_gen)[0]) for step in steps]
    assert len(set(alone)) > 3, "a temperature-0.9 sampler should not repeat one token"
    for at in (0, 3, len(OTHERS)):
        batch_params = [*OTHERS[:at], mine, *OTHERS[at:]]
        batch_gen = [p.make_generator() for p in batch_params]
        rows = [*range(at), len(OTHERS), *range(at, len(OTHERS))]
        batched = [int(sampler(step[rows], batch_params, batch_gen)[at]) for step in steps]
        assert batched == alone, f"at row {at}"
    replay_gen = [mine.make_generator()]
    assert [int(sampler(step[-1:], [mine], replay_gen)[0]) for step in steps] == alone


def test_rows_without_a_seed_draw_apart_in_one_batch():
    """64 unseeded rows of one peaked distribution: rows sharing one draw would give one token;
    independent rows give 10-23 distinct ones (400 batches: 10 in 1 %), so the bound sits well
    below that: an unseeded test must not fail by chance."""
    logits = _logits(1).expand(64, VOCAB)
    tokens = _sample(logits, [SamplingParams(temperature=2.0)] * 64)
    assert len(set(tokens.tolist())) > 4


@pytest.mark.parametrize("top_k", [-1, 0, VOCAB, VOCAB + 5])
def test_top_k_off_and_top_k_of_the_whole_vocabulary_truncate_nothing(top_k):
    """vLLM's top_k: -1 and 0 are off, and a k of the vocabulary or more keeps every token: the
    same seed draws the same tokens as with no top_k at all."""
    logits = _logits(1).expand(200, VOCAB)
    plain = SamplingParams(temperature=1.5, seed=3)
    limited = SamplingParams(temperature=1.5, seed=3, top_k=top_k)
    a = Sampler()(logits, [plain] * 200, [plain.make_generator()] * 200)
    b = Sampler()(logits, [limited] * 200, [limited.make_generator()] * 200)
    assert torch.equal(a, b) and len(set(a.tolist())) > 10


def test_temperatures_below_vllms_threshold_are_greedy():
    logits = _logits(6) * 1e3  # divided by 1e-6 these would overflow
    params = [SamplingParams(temperature=t, seed=1) for t in (1e-6, 9e-6, 0.0, 1e-7, 0.0, 5e-6)]
    assert all(p.greedy and p.make_generator() is None for p in params)
    assert torch.equal(_sample(logits, params), logits.argmax(-1))


def test_different_seeds_differ():
    logits = _logits(1).expand(8, VOCAB)
    tokens = _sample(logits, [SamplingParams(temperature=2.0, seed=s) for s in range(8)])
    assert len(set(tokens.tolist())) > 1


@pytest.mark.parametrize(
    "params",
    [{"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "top_p": 0.5}, {"min_p": 1.0}, {"min_p": 0.999}],
)
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


@pytest.mark.parametrize("min_p", [0.0, 0.3])
def test_frequencies_of_untruncated_rows_follow_the_softmax(min_p: float):
    """Rows without top-k or top-p (the inverse-CDF path): 4000 draws land in the softmax's
    proportions at their temperature, and never on a token min-p dropped."""
    logits = torch.tensor([[2.0, 1.0, 0.0, 1.5, -1.0] + [-30.0] * 5]).expand(4000, 10)
    params = SamplingParams(temperature=0.7, min_p=min_p, seed=3)
    generator = params.make_generator()
    tokens = Sampler()(logits, [params] * 4000, [generator] * 4000)
    counts = torch.bincount(tokens, minlength=10).float() / 4000
    expected = torch.softmax(logits[0] / 0.7, dim=0)
    expected[expected < min_p * expected.max()] = 0
    expected /= expected.sum()
    torch.testing.assert_close(counts, expected, atol=0.03, rtol=0)
    assert counts[expected == 0].sum() == 0


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
        ("temperature", -0.5, "greater than or equal to 0"),
        ("temperature", float("nan"), "finite number"),
        ("temperature", "hot", "valid number"),
        ("top_p", 0.0, "greater than 0"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("top_k", -2, "greater than or equal to -1"),
        ("top_k", 2.5, "valid integer"),
        ("seed", 2**64, "less than or equal to 18446744073709551615"),
        ("seed", True, "valid integer"),
        ("max_tokens", 0, "greater than or equal to 1"),
        ("stop", ["ok", ""], "a stop string has 1 to at most 256 characters"),
        ("ignore_eos", "yes", "valid boolean"),
        ("typical_p", 0.0, "greater than 0"),
        ("typical_p", 1.5, "less than or equal to 1"),
        ("min_p", -0.1, "greater than or equal to 0"),
        ("min_p", 1.5, "less than or equal to 1"),
        ("min_p", float("inf"), "finite number"),
        ("repetition_penalty", 0.0, "greater than 0"),
        ("repetition_penalty", -1.0, "greater than 0"),
        ("repetition_penalty", float("nan"), "finite number"),
        ("allowed_token_ids", (3, -1), "greater than or equal to 0"),
        ("allowed_token_ids", tuple(range(5000)), "at most 4096 items"),
        ("logit_bias", {"5": 101.0}, "less than or equal to 100"),
        ("logprobs", 21, "less than or equal to 20"),
        ("min_tokens", 17, r"min_tokens must be an integer in \[0, max_tokens 16\]"),
        ("skip_special_tokens", 0, "valid boolean"),
        ("spaces_between_special_tokens", None, "valid boolean"),
        ("include_stop_str_in_output", "no", "valid boolean"),
    ],
)
def test_bad_params_raise_naming_the_field(field, value, message):
    """The bounds are the request bodies' own (kvctl.api.SamplingFields): an engine caller
    gets the same refusal a client does, naming the field."""
    with pytest.raises(ValueError, match=message) as refused:
        SamplingParams(**{field: value})
    assert field in str(refused.value)


def test_defaults_and_stop_normalisation():
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (1.0, 1.0, 0, 16)
    assert params.seed is None and params.stop_strings == () and not params.ignore_eos
    assert SamplingParams(stop="\n").stop_strings == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop_strings == ("a", "b")
    assert SamplingParams(logit_bias={"9": 1.0, "2": -3.0}).bias == ((2, -3.0), (9, 1.0))
    assert SamplingParams(temperature=0).make_generator() is None
    assert SamplingParams(temperature=0.5).make_generator() is None  # the sampler's stream
    assert (params.min_p, params.repetition_penalty, params.allowed_token_ids) == (0.0, 1.0, None)
    assert params.skip_special_tokens and params.spaces_between_special_tokens
    assert not params.include_stop_str_in_output and not params.processes_logits
    assert SamplingParams(repetition_penalty=1.1).processes_logits
