"""The engine on the paged pool: same tokens as the contiguous baseline, whatever the pool does
between steps (defragmentation, resizes, preemption), and the request lifecycle."""

import pytest
import torch
from kv_device import DEVICE

from kvctl.agent.model import ContiguousKVCache, SamplingParams
from kvctl.agent.pool import DefragTrigger
from kvctl.agent.runtime import FinishReason, RequestTooLarge

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    "The pool is cut into pages.",
    "a",
    "Fragmentation hides free memory from large allocations, " * 3,
    "KV caches grow token by token",
    "0123456789",
]


def contiguous_greedy(model, tokenizer, prompts, new_tokens) -> list[list[int]]:
    """Reference: one request at a time on the contiguous cache."""
    out = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        cache = ContiguousKVCache(
            model.config, max_seqs=1, max_len=len(ids) + new_tokens, device=DEVICE
        )
        layout = cache.begin_step([0], [len(ids)])
        hidden = model(torch.tensor(ids, device=DEVICE), layout.positions(DEVICE), cache)
        tokens = [int(model.logits(hidden[-1:]).argmax(-1))]
        for _ in range(new_tokens - 1):
            layout = cache.begin_step([0], [1])
            hidden = model(
                torch.tensor(tokens[-1:], device=DEVICE), layout.positions(DEVICE), cache
            )
            tokens.append(int(model.logits(hidden).argmax(-1)))
        out.append(tokens)
    return out


def run(engine, prompts=PROMPTS, params=GREEDY, between_steps=None) -> list[list[int]]:
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
        if between_steps is not None:
            between_steps(engine)
    return [r.output_ids for r in requests]


def test_paged_greedy_matches_the_contiguous_cache(demo, make_engine) -> None:
    _, model, tokenizer = demo
    expected = contiguous_greedy(model, tokenizer, PROMPTS, GREEDY.max_tokens)
    assert run(make_engine()) == expected
    assert run(make_engine(page_size=16, pool_pages=64, segment_pages=16)) == expected


def test_defrag_and_resize_between_every_step_change_no_token(make_engine) -> None:
    moved = []
    grow = [True]

    def disturb(engine) -> None:
        report = engine.defragmenter.run(DefragTrigger.MANUAL)
        assert report.complete and engine.pool.stats().fragmentation_ratio == 0.0
        moved.append(report.pages_moved)
        capacity = engine.pool.capacity
        target = capacity + 32 if grow[0] else max(capacity - 32, 32)
        if target >= engine.pool.used_pages:
            engine.resizer.resize(target)
        grow[0] = not grow[0]
        engine.pool.invariants.check()

    engine = make_engine(max_batch_seqs=3)  # staggered admission: requests end at different times
    prompts = [*PROMPTS, "x" * 37, "short", "y" * 61]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        for n in (5, 30, 9, 17, 3, 24, 11, 20)
    ]
    requests = [engine.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
    reference = make_engine(max_batch_seqs=3)
    expected_requests = [reference.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
    while reference.has_work():
        reference.step()
    while engine.has_work():
        engine.step()
        disturb(engine)
    assert [r.output_ids for r in requests] == [r.output_ids for r in expected_requests]
    assert sum(moved) > 0, "the scenario must make the defragmenter move pages"


def test_a_small_pool_preempts_and_still_produces_the_same_tokens(make_engine) -> None:
    expected = run(make_engine())
    small = make_engine(pool_pages=56, segment_pages=8)  # 93 pages needed at once
    assert run(small) == expected
    assert small.stats.preemptions > 0
    small.pool.invariants.check()
    assert small.pool.used_pages == 0


def test_seeded_sampling_survives_preemption(make_engine) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7, max_tokens=24)
    assert run(make_engine(pool_pages=56, segment_pages=8), params=params) == run(
        make_engine(), params=params
    )


def test_stop_strings_eos_and_max_tokens(make_engine, demo) -> None:
    engine = make_engine()
    probe = run(engine, prompts=["stop here"], params=GREEDY)[0]
    text = demo[2].decode(probe)
    stop = text[5:7]
    request = engine.add_request(
        "stop here", SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    )
    events = []
    while engine.has_work():
        events.extend(engine.step())
    assert request.finish_reason is FinishReason.STOP
    assert request.text == text[: text.find(stop)]
    assert "".join(e.text for e in events) == request.text
    assert events[-1].finish_reason is FinishReason.STOP

    limited = engine.add_request([256, 65, 66], SamplingParams(temperature=0, max_tokens=3))
    while engine.has_work():
        engine.step()
    assert limited.finish_reason is FinishReason.LENGTH and len(limited.output_ids) == 3


def test_streamed_text_adds_up_to_the_output(make_engine, demo) -> None:
    engine = make_engine()
    request = engine.add_request(
        "héllo wörld", SamplingParams(temperature=0.8, seed=3, max_tokens=40)
    )
    pieces = []
    while engine.has_work():
        pieces.extend(e.text for e in engine.step() if e.request_id == request.request_id)
    assert (
        "".join(pieces)
        == request.text
        == demo[2].decode([t for t in request.output_ids if t not in demo[2].eos_token_ids])
    )


def test_the_last_event_carries_the_finished_requests_summary(make_engine) -> None:
    """The answer is built from the last event alone: the HTTP thread never reads the request."""
    engine = make_engine()
    request = engine.add_request("summary please", GREEDY)
    events = []
    while engine.has_work():
        events.extend(e for e in engine.step() if e.request_id == request.request_id)
    *tokens, last = events
    assert all(e.summary is None for e in tokens) and last.summary is not None
    assert last.summary.output_ids == tuple(e.token_id for e in events)
    assert last.summary.prompt_tokens == len(request.prompt_ids)
    assert (last.summary.cached_tokens, last.summary.finish_detail) == (0, None)


def test_abort_frees_the_pages(make_engine) -> None:
    engine = make_engine()
    a = engine.add_request("abc", GREEDY)
    b = engine.add_request("def", GREEDY)
    engine.step()
    engine.abort(a.request_id)
    assert a.finish_reason is FinishReason.ABORT
    while engine.has_work():
        engine.step()
    assert len(b.output_ids) == GREEDY.max_tokens
    engine.pool.invariants.check()
    assert engine.pool.used_pages == 0


def test_bad_prompts_are_refused(make_engine) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match=r"\[0, 258\)"):
        engine.add_request([1, 999], GREEDY)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        engine.add_request([65] * 10, SamplingParams(max_tokens=4096))
    assert not engine.has_work()


def test_a_request_larger_than_the_pool_is_refused_and_what_fits_runs_to_max_tokens(
    make_engine,
) -> None:
    engine = make_engine(pool_pages=8, segment_pages=8)  # 32 tokens of room
    with pytest.raises(RequestTooLarge, match="needs 16 pages of 4 tokens and the pool holds 8"):
        engine.add_request([65] * 40, GREEDY)
    with pytest.raises(RequestTooLarge, match="needs 13 pages"):
        engine.add_request([65] * 20, SamplingParams(temperature=0, max_tokens=30))
    grows = engine.add_request(
        [65] * 20, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    while engine.has_work():
        engine.step()
    assert grows.finish_reason is FinishReason.LENGTH and len(grows.output_ids) == 12
    engine.pool.invariants.check()
