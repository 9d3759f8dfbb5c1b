"""Prefixes evicted from the device come back from the host and disk tiers: the same greedy
tokens as recomputing them, every reused token counted in exactly one tier, and a damaged disk
page is a miss, never wrong K/V."""

import random

import pytest

from kvctl.agent.model import SamplingParams
from kvctl.agent.runtime import Engine

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def run(engine: Engine, prompt: list[int], salt: str | None = None):
    (request,) = [engine.add_request(prompt, GREEDY, cache_salt=salt)]
    while engine.has_work():
        engine.step()
        engine.pool.invariants.check()
        if engine.prefix_cache is not None:
            engine.prefix_cache.check()
        if engine.tiers is not None:
            engine.tiers.check()
    return request


def evict_all(engine: Engine, vocab: int) -> None:
    """Fill the device pool with other prompts until nothing of the earlier ones is left."""
    for prompt in prompts(vocab, 3, 100, seed=99):
        run(engine, prompt)


def hits(engine: Engine) -> dict[str, int]:
    return engine.stats.prefix_hits_by_tier


def test_a_prefix_evicted_from_the_device_is_served_from_the_host_tier(make_engine, demo):
    vocab = demo[0].vocab_size
    (prompt,) = prompts(vocab, 1, 40)
    expected = run(make_engine(prefix_cache=False), prompt).output_ids
    engine = make_engine(host_tier_bytes=1 << 24)
    assert run(engine, prompt).output_ids == expected
    evict_all(engine, vocab)
    again = run(engine, prompt)
    assert again.output_ids == expected
    assert again.cached_tokens == 36  # whole pages below the last token: 9 pages of 4
    by_tier = hits(engine)
    assert by_tier["host"] == 36 and by_tier["device"] == 0
    assert sum(by_tier.values()) == engine.stats.prefix_hits_tokens
    (host,) = engine.stats.tiers
    assert host.counters.loaded_pages == 9 and host.counters.stored_pages >= 9


def test_from_disk_when_the_host_tier_is_too_small(make_engine, demo, tmp_path):
    vocab = demo[0].vocab_size
    (prompt,) = prompts(vocab, 1, 40)
    expected = run(make_engine(prefix_cache=False), prompt).output_ids
    engine = make_engine(page_size=4)
    page = engine.storage.bytes_per_page
    engine = make_engine(
        host_tier_bytes=4 * page, disk_tier_path=str(tmp_path), disk_tier_bytes=1 << 26
    )
    run(engine, prompt)
    evict_all(engine, vocab)
    again = run(engine, prompt)
    assert again.output_ids == expected
    by_tier = hits(engine)
    assert by_tier["disk"] > 0
    assert sum(by_tier.values()) == engine.stats.prefix_hits_tokens == again.cached_tokens


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_disk_page_is_a_miss(make_engine, demo, tmp_path, damage):
    vocab = demo[0].vocab_size
    (prompt,) = prompts(vocab, 1, 40)
    expected = run(make_engine(prefix_cache=False), prompt).output_ids
    engine = make_engine(disk_tier_path=str(tmp_path), disk_tier_bytes=1 << 26)
    run(engine, prompt)
    evict_all(engine, vocab)
    engine.tiers.flush()
    files = sorted(tmp_path.glob("*.kvpage"))
    assert files
    for f in files:
        if damage == "truncate":
            f.write_bytes(f.read_bytes()[:-10])
        elif damage == "flip":
            blob = bytearray(f.read_bytes())
            blob[-1] ^= 0xFF
            f.write_bytes(bytes(blob))
        else:
            f.unlink()
    again = run(engine, prompt)
    assert again.output_ids == expected
    assert again.cached_tokens == 0
    (_, disk) = engine.stats.tiers
    reason = {"truncate": "truncated", "flip": "checksum", "delete": "missing"}[damage]
    assert disk.counters.load_failures[reason] == 1


def test_tiers_never_serve_another_tenants_pages(make_engine, demo):
    vocab = demo[0].vocab_size
    (prompt,) = prompts(vocab, 1, 40)
    engine = make_engine(host_tier_bytes=1 << 24)
    run(engine, prompt, salt="a")
    evict_all(engine, vocab)
    assert run(engine, prompt, salt="b").cached_tokens == 0
    assert run(engine, prompt, salt="a").cached_tokens == 36


def test_the_prefill_rate_is_measured_on_prompt_steps_only(make_engine, demo):
    vocab = demo[0].vocab_size
    engine = make_engine()
    (short,) = prompts(vocab, 1, 20)
    run(engine, short)
    assert engine.stats.prefill_seconds_per_token is None  # a 20-token step says little
    (long,) = prompts(vocab, 1, 100, seed=1)
    run(engine, long)
    measured = engine.stats.prefill_seconds_per_token
    assert measured is not None and 0 < measured < 1
