"""Sliding-window layers hold only their window: the pages a window has left go back to the pool
while the request runs, and nothing a request computes changes (transformers' greedy tokens),
through the prefix cache after the window moved, a host tier, preemption on a tiny pool, and
defragmentation and resizes between steps."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy, reference_model
from kv_device import DEVICE
from one_pool import one_pool_service

from kvctl.agent.model import SamplingParams, load_checkpoint
from kvctl.agent.pool.defrag import DefragTrigger
from kvctl.agent.runtime import Engine, EngineConfig
from kvctl.agent.runtime.layer_groups import layer_groups
from kvctl.settings import DefragSettings

transformers = pytest.importorskip("transformers")

PAGE = 4
WINDOW = 8  # the gemma3 variant's: layers 0 and 2 slide, layer 1 sees everything
NEW = 12


def test_gemma3_1bs_layers_make_one_full_group_and_six_sliding_ones() -> None:
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    groups = layer_groups(windows)
    assert groups.size == 4 and groups.count == 7
    assert groups.windows == (None, 512, 512, 512, 512, 512, 512)
    assert [groups.slots[i] for i in (5, 11, 17, 23)] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert groups.layers_of(6) == [24, 25]  # the last sliding group: 2 of its 4 slots used
    assert sorted(groups.slots) == sorted(set(groups.slots))  # no slot holds two layers


@pytest.mark.parametrize(
    ("windows", "count", "sliding"),
    [
        ([None, None], 1, ()),  # no sliding layer: as before
        ([64, 64, 64], 1, (0,)),  # every layer slides: one group, released whole
        ([64, None, 32], 1, ()),  # two windows: not split
    ],
)
def test_models_without_two_kinds_keep_one_group(windows, count, sliding) -> None:
    groups = layer_groups(windows)
    assert groups.count == count and groups.sliding == sliding and groups.size == len(windows)
    assert layer_groups([64, None], release=False).count == 1


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    reference = reference_model("gemma3")
    path = tmp_path_factory.mktemp("gemma3")
    reference.save_pretrained(path)
    return reference, path


def _engine(path, release: bool = True, pool_pages: int = 96, **more) -> Engine:
    _, model, tokenizer = load_checkpoint(path, DEVICE, torch.float32)
    more.setdefault("segment_pages", 16)
    config = EngineConfig(
        page_size=PAGE,
        pool_pages=pool_pages,
        defrag=DefragSettings(enabled=False),
        device=DEVICE,
        release_window_pages=release,
        **more,
    )
    return Engine(model, tokenizer, config)


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (length,), generator=gen).tolist() for _ in range(count)]


def _run(engine: Engine, prompts, disturb: bool = False, new: int = NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
        engine.pool.invariants.check()
        if engine.prefix_cache is not None:
            engine.prefix_cache.check()
        if disturb:
            engine.defragmenter.run(DefragTrigger.MANUAL)
            capacity = engine.pool.capacity
            engine.resizer.resize(capacity + 16)
            engine.resizer.resize(capacity)
    return [r.output_ids for r in requests]


def test_the_sliding_layers_give_back_their_pages_and_the_tokens_stay(gemma3) -> None:
    """A 30-token prompt and 12 tokens more: after every step each sliding group's table holds
    only the pages of the window and of the next token's slot (at most 3 of 4 tokens), while
    the full group's grows to all 10 (40 tokens after the last step it runs); with the pages
    kept instead, one table. Greedy tokens equal transformers' either way."""
    reference, path = gemma3
    (prompt,) = _prompts(1, 30, seed=1)
    expected = hf_greedy(reference, prompt, NEW)
    engine = _engine(path)
    assert engine.groups.count == 3 and engine.groups.sliding == (1, 2)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    request = engine.add_request(prompt, params)
    most = [0, 0, 0]
    while engine.has_work():
        engine.step()
        engine.pool.invariants.check()
        if engine.scheduler.pages.holds(request.seq_id):
            tables = engine.scheduler.pages.tables(request.seq_id)
            most = [max(m, len(t.pages)) for m, t in zip(most, tables, strict=True)]
    assert request.output_ids == expected
    assert most == [10, WINDOW // PAGE + 1, WINDOW // PAGE + 1]
    # the last release, at 41 computed tokens: keys from 34 on are read, pages 0-7 are not
    assert engine.scheduler.window_released == 2 * 8
    kept = _engine(path, release=False)
    assert kept.groups.count == 1
    assert _run(kept, [prompt]) == [expected]


def test_a_prefix_hit_after_the_window_moved_reuses_what_is_still_valid(gemma3) -> None:
    """A prompt's pages enter the prefix cache before its window leaves them, so the same
    prompt again, longer than the window, is found whole and continues as transformers does;
    so are the greedy tokens of a batch under defragmentation and resizes between steps."""
    reference, path = gemma3
    prompts = _prompts(3, 26, seed=2)
    expected = [hf_greedy(reference, p, NEW) for p in prompts]
    engine = _engine(path)
    assert _run(engine, prompts) == expected
    again = engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=NEW))
    while engine.has_work():
        engine.step()
    assert again.cached_tokens == 24 and again.output_ids == expected[0]
    assert _run(engine, prompts, disturb=True) == expected


def test_a_tiny_pool_preempts_and_still_gives_transformers_tokens(gemma3) -> None:
    """Four requests of 10 prompt tokens and 40 more on 40 pages: admitted with 9 pages each,
    their full group grows to 13 pages while their windows give pages back, and together they
    outgrow the pool, so some are preempted and computed again."""
    reference, path = gemma3
    prompts = _prompts(4, 10, seed=3)
    expected = [hf_greedy(reference, p, 40) for p in prompts]
    engine = _engine(path, pool_pages=40, segment_pages=8, prefix_cache=False)
    assert _run(engine, prompts, new=40) == expected
    assert engine.scheduler.preemptions > 0 and engine.scheduler.window_released > 0


def test_a_host_tier_serves_every_groups_pages(gemma3) -> None:
    """Evicted from the device, a prompt's pages of every group come back from the host tier
    (each group's partition apart) and give transformers' tokens; the hit counts each token
    once."""
    reference, path = gemma3
    (prompt,) = _prompts(1, 26, seed=4)
    expected = hf_greedy(reference, prompt, NEW)
    engine = _engine(path, pool_pages=64, host_tier_bytes=1 << 24)
    assert _run(engine, [prompt]) == [expected]
    assert _run(engine, _prompts(4, 40, seed=5))  # fills the device: the prompt is evicted
    before = engine.stats.prefix_hits_by_tier.get("host", 0)
    assert _run(engine, [prompt]) == [expected]
    assert engine.stats.prefix_hits_by_tier["host"] - before == 24


def test_the_pool_shows_the_window_pages_apart(gemma3) -> None:
    """While a long request runs, its sliding groups' pages are the map's `window` pages, as
    many as the reading's `window_pages`; `kvctl pool show`, the map legend and the metrics say
    them apart from the other used pages."""
    from kvctl.agent.pool.stats import PageState
    from kvctl.api import PoolMap
    from kvctl.view import poolmap, render

    _, path = gemma3
    engine = _engine(path)
    (prompt,) = _prompts(1, 30, seed=6)
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    for _ in range(3):
        engine.step()
    stats = engine.stats
    states, snapshot = one_pool_service(engine).pool(None).page_states_and_snapshot()
    runs = states.runs()
    window = sum(r.length for r in runs if r.state is PageState.WINDOW)
    used = sum(r.length for r in runs if r.state is PageState.USED)
    # 32 tokens computed: the next query reads keys from 25 on, so each sliding table keeps
    # pages 6 and 7 and gave back pages 0-5
    assert window == stats.window_pages == 2 * 2
    assert used + window == stats.pool.used_pages
    assert stats.window_released_pages == 2 * 6 and stats.page_groups == 3
    page_map = PoolMap(
        capacity_pages=engine.pool.capacity,
        segment_pages=engine.pool.segment_pages,
        runs=[(r.state.value, r.start, r.length) for r in runs],
    )
    assert f"window {window}" in poolmap.legend(page_map).plain
    assert snapshot.window_pages == window and snapshot.page_groups == 3
    shown = render.window_summary(snapshot)
    assert shown is not None and "3 page tables per request" in shown
    assert f"{window} used pages in sliding windows" in shown and "12 given back" in shown
