"""OpenAI's and vLLM's generation fields on the engine against transformers' logits and
tokenizer: log-probabilities, presence/frequency penalties (OpenAI's formula over the generated
tokens), the repetition penalty (transformers' `RepetitionPenaltyLogitsProcessor` over prompt
and output), `logit_bias` (`SequenceBiasLogitsProcessor`), `allowed_token_ids`, truncation to
the top token by top-k, top-p or min-p, `min_tokens`, `stop_token_ids`, special tokens in the
text (transformers' `decode(skip_special_tokens=..., spaces_between_special_tokens=...)`),
`include_stop_str_in_output`, and `n` choices sharing their prompt's pages."""

import pytest
import torch
from hf_chat import hf_greedy, hf_tokenizer, save_chat_checkpoint

from kvctl.agent.model import load_checkpoint
from kvctl.agent.model.sampling import SamplingParams
from kvctl.agent.runtime import Engine, EngineConfig

transformers = pytest.importorskip("transformers")

PROMPT = [1, 9, 17, 33, 47, 60, 61, 62, 90, 100, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # 19 tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("fields")
    model, _ = save_chat_checkpoint(transformers, root, seed=11)
    return model, root


def engine_of(root) -> Engine:
    _, model, tokenizer = load_checkpoint(root, "cpu", torch.float32)
    return Engine(model, tokenizer, EngineConfig(pool_pages=64, segment_pages=16, page_size=4))


def events_of(engine: Engine, requests) -> dict:
    events: dict[str, list] = {r.request_id: [] for r in requests}
    while engine.has_work():
        for event in engine.step():
            events[event.request_id].append(event)
    return events


def test_logprobs_are_log_softmax_of_transformers_logits(checkpoint):
    reference, root = checkpoint
    engine = engine_of(root)
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=8, logprobs=5, ignore_eos=True)
    request = engine.add_request(PROMPT, params)
    events = [e for e in events_of(engine, [request])[request.request_id] if e.token_id is not None]
    assert len(events) == 8
    for step, event in enumerate(events):
        with torch.no_grad():
            context = torch.tensor([PROMPT + request.output_ids[:step]])
            expected = reference(context).logits[0, -1].float().log_softmax(-1)
        assert event.logprobs.logprob == pytest.approx(float(expected[event.token_id]), abs=1e-4)
        values, ids = expected.topk(5)
        assert [t for t, _ in event.logprobs.top] == ids.tolist()
        torch.testing.assert_close(
            torch.tensor([lp for _, lp in event.logprobs.top]), values, atol=1e-4, rtol=0
        )


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 1.2), (2.0, -0.4)])
def test_penalties_follow_openais_formula_over_generated_tokens(checkpoint, presence, frequency):
    reference, root = checkpoint

    def penalised(logits, generated):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=128)
        counts = counts.float() if generated else torch.zeros(128)
        return logits - counts * frequency - (counts > 0).float() * presence

    expected = hf_greedy(reference, PROMPT, 16, penalised)
    plain = hf_greedy(reference, PROMPT, 16)
    assert expected != plain, "the penalties should change this greedy continuation"
    engine = engine_of(root)
    params = SamplingParams(
        temperature=0, max_tokens=16, presence_penalty=presence, frequency_penalty=frequency
    )
    [request] = engine.generate([PROMPT], params)
    assert request.output_ids == expected


@pytest.mark.parametrize(
    ("penalty", "presence"),
    [(1.5, 0.0), (0.6, 0.0), (1.3, 0.8)],
    ids=["1.5", "0.6", "1.3+presence"],
)
def test_repetition_penalty_equals_transformers_over_prompt_and_output(
    checkpoint, penalty, presence
):
    reference, root = checkpoint
    processor = transformers.RepetitionPenaltyLogitsProcessor(penalty)

    def penalised(logits, generated):
        row = processor(torch.tensor([PROMPT + generated]), logits[None].clone())[0]
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=128)
        return row - (counts > 0).float() * presence

    expected = hf_greedy(reference, PROMPT, 16, penalised)
    assert expected != hf_greedy(reference, PROMPT, 16), "the penalty should change the tokens"
    engine = engine_of(root)
    params = SamplingParams(
        temperature=0, max_tokens=16, repetition_penalty=penalty, presence_penalty=presence
    )
    [request] = engine.generate([PROMPT], params)
    assert request.output_ids == expected


@pytest.mark.parametrize(
    "truncation",
    [{"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}, {"top_k": 1, "min_p": 0.5, "top_p": 0.3}],
    ids=lambda t: ",".join(t),
)
def test_sampling_truncated_to_the_top_token_is_transformers_greedy(checkpoint, truncation):
    reference, root = checkpoint
    engine = engine_of(root)
    params = SamplingParams(temperature=1.3, seed=9, max_tokens=14, **truncation)
    [request] = engine.generate([PROMPT], params)
    assert request.output_ids == hf_greedy(reference, PROMPT, 14)


def test_allowed_token_ids_leave_only_those_to_choose(checkpoint):
    reference, root = checkpoint
    allowed = [5, 17, 33, 40, 41, 90, 2]
    blocked = torch.ones(128, dtype=torch.bool)
    blocked[allowed] = False
    expected = hf_greedy(reference, PROMPT, 12, lambda logits, _: logits.masked_fill(blocked, -1e9))
    assert set(expected) <= set(allowed) and expected != hf_greedy(reference, PROMPT, 12)
    engine = engine_of(root)
    params = SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=tuple(allowed))
    [greedy] = engine.generate([PROMPT], params)
    assert greedy.output_ids == expected
    sampled = SamplingParams(
        temperature=1.5, seed=2, max_tokens=40, ignore_eos=True, allowed_token_ids=(5, 17, 33)
    )
    [request] = engine.generate([PROMPT], sampled)
    assert set(request.output_ids) == {5, 17, 33}


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_special_tokens_in_the_text_are_transformers_decode(checkpoint, skip, spaces):
    """Special tokens (<unk>, <s>, </s> here; EOS too, which ignore_eos generates past) are
    left out or kept exactly as transformers' fast tokenizer decodes them; it ignores
    spaces_between_special_tokens, and so does the agent."""
    _, root = checkpoint
    tokenizer = hf_tokenizer(transformers)
    engine = engine_of(root)
    params = SamplingParams(
        temperature=8.0,
        seed=4,
        max_tokens=40,
        ignore_eos=True,
        allowed_token_ids=(0, 1, 2, 3, 7, 8, 9),
        skip_special_tokens=skip,
        spaces_between_special_tokens=spaces,
    )
    request = engine.add_request(PROMPT, params)
    streamed = "".join(e.text for e in events_of(engine, [request])[request.request_id])
    assert {0, 1, 2} <= set(request.output_ids) and 3 in request.output_ids
    expected = tokenizer.decode(
        request.output_ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces
    )
    assert streamed == request.text == expected
    assert ("<s>" in expected) is not skip


def test_stop_strings_and_tokens_kept_with_include_stop_str_in_output(checkpoint):
    """vLLM's include_stop_str_in_output: the text ends with the matched stop string, or with
    the stop token's text, instead of before it."""
    reference, root = checkpoint
    tokenizer = hf_tokenizer(transformers)
    plain = hf_greedy(reference, PROMPT, 16)
    full = tokenizer.decode(plain, skip_special_tokens=True)
    stop = f"w{plain[4]} "
    cut = full.index(stop)
    engine = engine_of(root)
    for include, expected in ((False, full[:cut]), (True, full[: cut + len(stop)])):
        params = SamplingParams(
            temperature=0, max_tokens=16, stop=[stop], include_stop_str_in_output=include
        )
        request = engine.add_request(PROMPT, params)
        streamed = "".join(e.text for e in events_of(engine, [request])[request.request_id])
        assert streamed == request.text == expected and request.finish_reason == "stop"
    first = plain.index(plain[6])
    for include, kept in ((False, plain[:first]), (True, plain[: first + 1])):
        params = SamplingParams(
            temperature=0,
            max_tokens=16,
            stop_token_ids=(plain[6],),
            include_stop_str_in_output=include,
        )
        [request] = engine.generate([PROMPT], params)
        assert request.output_ids == plain[: first + 1]
        assert request.text == tokenizer.decode(kept, skip_special_tokens=True)


def test_logit_bias_equals_transformers_sequence_bias(checkpoint):
    reference, root = checkpoint
    plain = hf_greedy(reference, PROMPT, 10)
    bias = {plain[0]: -100.0, 77: 6.0, 3: 2.5}
    processor = transformers.SequenceBiasLogitsProcessor(
        sequence_bias=[[[t], b] for t, b in bias.items()]
    )

    def biased(logits, generated):
        ids = torch.tensor([PROMPT + generated])
        return processor(ids, logits[None].clone())[0]

    expected = hf_greedy(reference, PROMPT, 10, biased)
    assert expected[0] != plain[0]
    engine = engine_of(root)
    params = SamplingParams(
        temperature=0, max_tokens=10, logit_bias={str(t): b for t, b in bias.items()}
    )
    [request] = engine.generate([PROMPT], params)
    assert request.output_ids == expected


def test_min_tokens_and_stop_token_ids(checkpoint):
    reference, root = checkpoint
    plain = hf_greedy(reference, PROMPT, 12)
    stop_at = plain[5]
    engine = engine_of(root)
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop_at,))
    [stopped] = engine.generate([PROMPT], params)
    first = plain.index(stop_at)
    assert stopped.output_ids == plain[: first + 1] and stopped.finish_reason == "stop"
    eos_first = SamplingParams(temperature=0, max_tokens=6, logit_bias={"2": 100.0}, min_tokens=4)
    [late] = engine.generate([PROMPT], eos_first)
    assert 2 not in late.output_ids[:4] and late.output_ids[4] == 2
    assert late.finish_reason == "stop" and len(late.output_ids) == 5


def test_n_choices_share_the_prompt_pages_and_sample_apart(checkpoint):
    _, root = checkpoint
    engine = engine_of(root)
    seeded = SamplingParams(temperature=1.0, seed=21, max_tokens=12, ignore_eos=True)
    first = engine.add_request(PROMPT, seeded, "a")
    others = [
        engine.add_request(PROMPT, seeded, f"a-{i}", first_choice="a", choice=i) for i in (1, 2)
    ]
    shared = set()
    while engine.has_work():
        engine.step()
        engine.pool.invariants.check()
        engine.prefix_cache.check()
        if all(engine.pool.__contains__(r.seq_id) for r in (first, *others)):
            tables = [engine.pool.table(r.seq_id).pages for r in (first, *others)]
            shared |= set(tables[0][:4]) & set(tables[1][:4]) & set(tables[2][:4])
    assert len(shared) == 4, "the three choices hold the prompt's 4 whole pages together"
    assert [r.cached_tokens for r in others] == [16, 16]
    outputs = {tuple(r.output_ids) for r in (first, *others)}
    assert len(outputs) == 3, "each seeded choice is its own sample"
    alone = engine_of(root)
    [again] = alone.generate([PROMPT], seeded)
    assert again.output_ids == first.output_ids, "choice 0 is the seed's own sample"
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = engine.add_request(PROMPT, greedy, "g")
    b = engine.add_request(PROMPT, greedy, "g-1", first_choice="g", choice=1)
    events_of(engine, [a, b])
    assert a.output_ids == b.output_ids
