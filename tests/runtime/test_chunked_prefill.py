"""Chunked prefill: a step computes at most `max_batched_tokens` tokens, decode tokens first, then
chunks of prompts; a long prompt is cut into chunks interleaved with the running requests'
decode steps, and the greedy tokens are those of an unlimited budget whatever happens between
(preemption mid-prefill, prefix hits, defragmentation, resizes)."""

from __future__ import annotations

import contextlib
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.agent.config import ConfigError, load_config
from kvctl.agent.model import SamplingParams
from kvctl.agent.pool import DefragTrigger, ResizeRefused
from kvctl.agent.runtime import Engine, EngineConfig, FinishReason, ScheduledBatch

UNLIMITED = 1 << 20


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def prompt(length: int, seed: int = 0) -> list[int]:
    return [32 + (seed * 37 + j * 11) % 90 for j in range(length)]


def record_batches(engine: Engine) -> list[ScheduledBatch]:
    """Every batch the engine's scheduler hands out from now on."""
    batches: list[ScheduledBatch] = []
    schedule = engine.scheduler.schedule

    def recording() -> ScheduledBatch | None:
        batch = schedule()
        if batch is not None:
            batches.append(batch)
        return batch

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return batches


def test_a_long_prompt_is_cut_into_ceil_len_over_budget_chunks(make_engine) -> None:
    engine = make_engine(max_batched_tokens=16, max_batch_seqs=4)
    batches = record_batches(engine)
    request = engine.add_request(prompt(100), greedy(3))
    while not request.output_ids:
        assert engine.step() == [] or request.output_ids
    assert [b.new_tokens for b in batches] == [[16]] * 6 + [[4]]
    assert [b.computed for b in batches] == [[16 * i] for i in range(7)]
    assert len(batches) == math.ceil(100 / 16)
    assert engine.pool.table(request.seq_id).num_tokens == 100  # pages held since admission


def test_no_step_exceeds_the_budget_and_decodes_come_first(make_engine) -> None:
    engine = make_engine(max_batched_tokens=12, max_batch_seqs=4)
    batches = record_batches(engine)
    for i, length in enumerate((40, 3, 25, 9, 60, 1)):
        engine.add_request(prompt(length, i), greedy(6))
        engine.step()
    while engine.has_work():
        engine.step()
    assert batches and all(b.num_tokens <= 12 for b in batches)
    assert any(b.is_prefill and 1 in b.new_tokens for b in batches), "no mixed step"
    for batch in batches:
        decoding = [n == 1 and c + 1 == r.num_tokens for r, c, n in _rows(batch)]
        # decode tokens lead the batch: no decode row follows a prompt chunk
        assert decoding == sorted(decoding, reverse=True)


def _rows(batch: ScheduledBatch):
    return zip(batch.requests, batch.computed, batch.new_tokens, strict=True)


def test_running_streams_get_a_token_in_every_step_while_a_long_prompt_prefills(
    make_engine,
) -> None:
    engine = make_engine(max_batched_tokens=16, max_batch_seqs=8)
    streams = [engine.add_request(prompt(8, i), greedy(40)) for i in range(3)]
    while not all(s.output_ids for s in streams):
        engine.step()
    long = engine.add_request(prompt(120, 9), greedy(2))
    steps = 0
    while not long.output_ids:
        produced = {e.request_id for e in engine.step()}
        assert produced >= {s.request_id for s in streams}, "a stream missed a step"
        steps += 1
    # 3 decode tokens a step leave 13 for the prompt: ceil(120 / 13) steps
    assert steps == math.ceil(120 / 13)


def test_a_prompt_within_the_budget_but_long_is_capped_while_streams_decode(make_engine) -> None:
    """A prompt the budget could hold in one step but with more than `long_prompt_tokens` to
    compute gets the cap while others decode; once its prefix is cached, the short rest is
    computed whole."""
    engine = make_engine(
        max_batched_tokens=256,
        max_batch_seqs=8,
        long_prompt_tokens=40,
        max_prefill_while_decoding=8,
    )
    batches = record_batches(engine)
    streams = [engine.add_request(prompt(4, i), greedy(60)) for i in range(2)]
    while not all(s.output_ids for s in streams):
        engine.step()
    long = engine.add_request(prompt(96, 7), greedy(2))
    while not long.output_ids:
        engine.step()
    chunks = [n for b in batches for r, _, n in _rows(b) if r is long]
    assert chunks == [8] * 12  # 96 tokens, 8 a step beside the two streams

    again = engine.add_request(prompt(96, 7) + prompt(20, 8), greedy(2))
    while not again.output_ids:
        engine.step()
    rest = [n for b in batches for r, _, n in _rows(b) if r is again]
    assert again.cached_tokens >= 80 and rest == [116 - again.cached_tokens]


def test_chunked_and_unlimited_budgets_give_the_same_tokens(make_engine) -> None:
    prompts = [prompt(n, i) for i, n in enumerate((70, 5, 33, 1, 48, 17))]
    params = [greedy(n) for n in (9, 20, 4, 12, 7, 15)]
    outputs = []
    # (budget, prompt tokens a step for long prompts while others decode; 0: no cap)
    for budget, cap in ((UNLIMITED, 0), (64, 0), (64, 5), (8, 1), (6, 0)):
        engine = make_engine(
            max_batched_tokens=budget, max_batch_seqs=6, max_prefill_while_decoding=cap
        )
        requests = [engine.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
        while engine.has_work():
            engine.step()
        outputs.append([r.output_ids for r in requests])
    assert all(output == outputs[0] for output in outputs)


def test_a_prompt_preempted_mid_prefill_resumes_from_its_cached_pages(make_engine) -> None:
    """Two streams need pages while a long prompt is half computed: the prompt (the youngest) is
    preempted, its computed whole pages go to the prefix cache, and when re-admitted it adopts
    them and computes only the rest; every token is that of a roomy pool."""
    streams, long = [prompt(4, 1), prompt(4, 2)], prompt(24, 3)

    def run(engine: Engine) -> list[list[int]]:
        first = [engine.add_request(p, greedy(20)) for p in streams]
        while len(first[0].output_ids) < 8:
            engine.step()
        last = engine.add_request(long, greedy(5))
        while engine.has_work():
            engine.step()
            engine.pool.invariants.check()
            if engine.prefix_cache is not None:
                engine.prefix_cache.check()
        return [r.output_ids for r in (*first, last)]

    expected = run(make_engine(max_batched_tokens=UNLIMITED, prefix_cache=False))
    engine = make_engine(pool_pages=16, segment_pages=16, max_batched_tokens=4, max_batch_seqs=3)
    mid_prefill: list[tuple[int, int]] = []
    preempt = engine.scheduler.preempt

    def recording(request, reason: str = "growth") -> None:
        if not request.output_ids:
            mid_prefill.append((request.num_computed, len(request.prompt_ids)))
        preempt(request, reason)

    engine.scheduler.preempt = recording  # type: ignore[method-assign]
    assert run(engine) == expected
    assert any(0 < done < total for done, total in mid_prefill), mid_prefill
    assert engine.stats.prefix_hits_tokens >= 8  # the resumed prompt found its own pages
    assert engine.pool.used_pages == 0


def test_a_computed_prompt_prefix_is_shared_before_its_request_ends(make_engine) -> None:
    """A burst of prompts with a shared prefix: the first computes it in chunks, and the ones
    admitted after adopt its whole computed pages instead of computing them again."""
    shared = prompt(40, 5)
    engine = make_engine(max_batched_tokens=16, max_batch_seqs=4)
    first = engine.add_request([*shared, *prompt(8, 6)], greedy(4))
    second = engine.add_request([*shared, *prompt(8, 7)], greedy(4))
    while engine.has_work():
        engine.step()
    assert (first.cached_tokens, second.cached_tokens) == (0, 40)  # 10 whole pages of 4
    reference = make_engine(prefix_cache=False, max_batched_tokens=UNLIMITED)
    assert [
        r.output_ids for r in reference.generate([first.prompt_ids, second.prompt_ids], greedy(4))
    ] == [first.output_ids, second.output_ids]


@st.composite
def workloads(draw):
    page_size = draw(st.sampled_from([2, 3, 4]))
    pages = draw(st.integers(12, 40))
    budget = draw(st.integers(2, 9))
    shared = draw(st.integers(0, 20))
    arrivals = draw(
        st.lists(
            st.tuples(
                st.integers(0, 3),  # steps before this arrival
                st.integers(1, 30),  # own prompt tokens after the shared prefix
                st.integers(1, 10),  # max_tokens
                st.booleans(),  # starts with the shared prefix
            ),
            min_size=1,
            max_size=7,
        )
    )
    disturb = draw(st.sampled_from(["none", "defrag", "resize"]))
    return page_size, pages, budget, shared, arrivals, disturb


@pytest.mark.slow
@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads())
def test_random_workloads_give_the_same_tokens_with_a_small_budget(make_engine, workload):
    """Random arrivals (with a shared prefix, on pools small enough to preempt) under a budget
    of 2-9 tokens a step, with defragmentation or resizes between steps, give exactly the greedy
    tokens of an unlimited budget on a roomy pool (fp32, CPU), and never exceed the budget."""
    page_size, pages, budget, shared, arrivals, disturb = workload
    base = prompt(shared, 99)
    room = -(-pages // 4) * 4 * page_size  # the pool's tokens (whole segments of 4 pages)
    jobs = [
        ((base if with_shared else []) + prompt(own, i), greedy(max_tokens), wait)
        for i, (wait, own, max_tokens, with_shared) in enumerate(arrivals)
        if (shared if with_shared else 0) + own + max_tokens <= room
    ]

    def run(engine: Engine, between=None) -> list[list[int]]:
        requests = []
        for ids, params, wait in jobs:
            for _ in range(wait):
                if engine.has_work():
                    engine.step()
                    if between:
                        between(engine)
            requests.append(engine.add_request(ids, params))
        while engine.has_work():
            engine.step()
            if between:
                between(engine)
        return [r.output_ids for r in requests]

    reference = make_engine(page_size=page_size, pool_pages=256, max_batched_tokens=UNLIMITED)
    expected = run(reference)
    engine = make_engine(
        page_size=page_size,
        pool_pages=pages,
        segment_pages=4,
        max_pool_pages=2 * pages,
        max_batched_tokens=budget,
        max_batch_seqs=min(budget, 4),
        max_prefill_while_decoding=budget // 3,  # 0 (no cap) at 2, else 1-3 tokens
    )
    batches = record_batches(engine)
    grow = [True]

    def between(engine: Engine) -> None:
        if disturb == "defrag":
            engine.defragmenter.run(DefragTrigger.MANUAL)
        elif disturb == "resize":  # grow by a segment, then back (refused while in use)
            target = room // page_size + (4 if grow[0] else 0)
            grow[0] = not grow[0]
            with contextlib.suppress(ResizeRefused):
                engine.resizer.resize(target)
        engine.pool.invariants.check()
        engine.prefix_cache.check()

    assert run(engine, between) == expected
    assert all(b.num_tokens <= budget for b in batches)
    assert engine.pool.used_pages == 0


def test_max_batched_tokens_flag_key_and_former_name(tmp_path) -> None:
    assert load_config({}).max_batched_tokens == 2048
    assert load_config({"max_batched_tokens": 2048}).max_batched_tokens == 2048
    path = tmp_path / "agent.toml"
    path.write_text("max_batch_tokens = 1024\n")
    assert load_config({}, path).max_batched_tokens == 1024  # the former key still works
    assert load_config({"max_batched_tokens": 256}, path).max_batched_tokens == 256
    with pytest.raises(ConfigError, match="below --max-batch-seqs 64"):
        load_config({"max_batched_tokens": 32})
    with pytest.raises(ValueError, match="at least max_batch_seqs"):
        EngineConfig(max_batch_seqs=8, max_batched_tokens=4)


def test_while_requests_decode_a_step_computes_at_most_the_prefill_cap(make_engine) -> None:
    """A long prompt (one the budget cannot hold) arriving while others decode is cut to the cap,
    so their gap stays small; alone, it gets the whole budget; a prompt the budget holds is
    computed whole (a burst of short requests keeps its throughput)."""
    engine = make_engine(max_batched_tokens=64, max_batch_seqs=4, max_prefill_while_decoding=8)
    batches = record_batches(engine)
    alone = engine.add_request(prompt(100, 1), greedy(2))
    while not alone.output_ids:
        engine.step()
    assert [b.new_tokens for b in batches] == [[64], [36]]
    streams = [engine.add_request(prompt(5, s), greedy(40)) for s in (2, 3)]
    while any(not s.output_ids for s in streams):
        engine.step()
    batches.clear()
    late = engine.add_request(prompt(100, 4), greedy(2))
    while not late.output_ids:
        engine.step()
    chunks = [n for b in batches for r, _, n in _rows(b) if r is late]
    assert chunks == [8] * 12 + [4]
    assert all(sum(n for r, _, n in _rows(b) if r is not late) >= 2 for b in batches)
    batches.clear()
    short = engine.add_request(prompt(40, 5), greedy(2))  # the budget holds it: computed whole
    while not short.output_ids:
        engine.step()
    assert [n for b in batches for r, _, n in _rows(b) if r is short] == [40]


def test_by_default_a_long_prompt_fills_the_budget_while_others_decode(make_engine) -> None:
    """No cap unless one is set: a 1,000-token prompt arriving while a request decodes takes
    all the budget that request leaves, as vLLM's policy does (a cap of 32 had kept a long
    prompt's first token waiting 9.9 times longer on a 16-stream load)."""
    engine = make_engine(max_batched_tokens=256, max_batch_seqs=4, pool_pages=256)
    assert engine.scheduler.prefill_while_decoding == 0
    batches = record_batches(engine)
    decoding = engine.add_request(prompt(8, 1), greedy(40))
    engine.step()
    late = engine.add_request(prompt(1000, 3), greedy(2))
    while not late.output_ids:
        engine.step()
    chunks = [n for b in batches for r, _, n in _rows(b) if r is late]
    assert chunks == [255, 255, 255, 235]
    assert not decoding.finished


def test_a_preempted_long_prompt_readmitted_from_the_cache_always_gets_tokens(make_engine):
    """A long prompt preempted after its prefill finds its pages cached when it comes back, so
    admission judged it short; the step's chunking judged it long by its first admission's cache
    hit and gave it 0 tokens of a used-up long-prompt budget, and the step failed ("every
    sequence in a step needs ≥ 1 new token"). Admission and chunking now judge alike."""
    engine = make_engine(
        pool_pages=256, long_prompt_tokens=16, max_prefill_while_decoding=8, max_batched_tokens=64
    )
    scheduler = engine.scheduler
    decoding = engine.add_request([1, 2, 3], greedy(60))
    engine.step()
    first = engine.add_request(list(range(10, 50)), greedy(6))  # 40 tokens: long
    for _ in range(20):  # its prefill, 8 tokens a step while `decoding` decodes
        if first.output_ids:
            break
        engine.step()
    assert first.output_ids and not first.finished
    second = engine.add_request(list(range(60, 120)), greedy(2))  # long, computed 8 a step
    engine.step()
    assert 0 < second.num_computed < second.num_tokens
    scheduler.preempt(first)  # its computed pages go to the prefix cache
    for _ in range(200):  # each step: the decode, 8 tokens of `second`, then `first` waits
        if not engine.has_work():
            break
        engine.step()
    for request in (decoding, first, second):
        assert request.finish_reason is FinishReason.LENGTH
