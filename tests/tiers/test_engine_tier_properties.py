"""Hypothesis: waves of prompts sharing prefixes through an engine with a tiny pool, a host tier
and a disk tier, with defragmentation, pool resizes and tier resizes between steps.

Prefixes are evicted from the device into the tiers and loaded back again and again; the greedy
tokens must be those of an engine without a prefix cache (which computes every prompt alone),
and after every step the pool's invariants, the prefix cache's and the tiers' must hold. A wave
without preemptions reuses exactly the tokens its requests report as cached, and every tier's
hits are its loaded pages' tokens.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
from functools import cache
from pathlib import Path

import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from kv_device import DEVICE

from kvctl.agent.model import SamplingParams, build_demo_model
from kvctl.agent.pool import DefragTrigger, ResizeRefused
from kvctl.agent.runtime import Engine, EngineConfig
from kvctl.settings import DefragSettings

PAGE = 4
SEGMENT = 8
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
MAX_STEPS = 400  # a wave that takes longer is stuck


@cache
def demo():
    return build_demo_model(DEVICE, torch.float32, seed=0)


@cache
def bases() -> tuple[tuple[int, ...], ...]:
    vocab = demo()[0].vocab_size
    rng = random.Random(5)
    return tuple(tuple(rng.randrange(3, vocab) for _ in range(36)) for _ in range(3))


@cache
def reference_engine() -> Engine:
    _, model, tokenizer = demo()
    config = EngineConfig(
        page_size=PAGE,
        pool_pages=64,
        segment_pages=SEGMENT,
        prefix_cache=False,
        device=DEVICE,
        defrag=DefragSettings(enabled=False),
    )
    return Engine(model, tokenizer, config)


@cache
def expected(prompt: tuple[int, ...]) -> list[int]:
    """The greedy tokens of `prompt` computed alone, with nothing cached."""
    return reference_engine().generate([list(prompt)], GREEDY)[0].output_ids


prompts = st.builds(
    lambda base, cut, suffix: list(bases()[base][:cut]) + suffix,
    st.integers(0, 2),
    st.integers(4, 36),
    st.lists(st.integers(3, 200), max_size=6),
)


class EngineTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvctl-engine-tiers-"))
        _, model, tokenizer = demo()
        page_bytes = 4 * 2 * PAGE * 4 * 32 * 4  # layers, K/V, tokens, kv heads, head dim, fp32
        self.engine = Engine(
            model,
            tokenizer,
            EngineConfig(
                page_size=PAGE,
                pool_pages=3 * SEGMENT,
                segment_pages=SEGMENT,
                max_pool_pages=6 * SEGMENT,
                device=DEVICE,
                defrag=DefragSettings(enabled=False),
                host_tier_bytes=12 * page_bytes,
                disk_tier_path=str(self.dir),
                disk_tier_bytes=24 * (page_bytes + 48),
            ),
        )
        assert self.engine.storage.bytes_per_page == page_bytes
        self.tiers = self.engine.tiers
        assert self.tiers is not None and [t.name for t in self.tiers.tiers] == ["host", "disk"]

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(
        batch=st.lists(prompts, min_size=1, max_size=4),
        salt=st.sampled_from([None, "t"]),
        data=st.data(),
    )
    def wave(self, batch: list[list[int]], salt: str | None, data: st.DataObject) -> None:
        """Prompts arriving together, run to the end; between steps the pool or a tier may be
        defragmented or resized."""
        engine = self.engine
        before = engine.stats
        requests = [engine.add_request(p, GREEDY, cache_salt=salt) for p in batch]
        for _ in range(MAX_STEPS):
            if not engine.has_work():
                break
            engine.step()
            self.check()
            self.between_steps(data)
        else:
            raise AssertionError("the wave did not finish")
        for prompt, request in zip(batch, requests, strict=True):
            assert request.output_ids == expected(tuple(prompt)), "tokens differ"
            assert 0 <= request.cached_tokens < len(prompt)
        after = engine.stats
        by_tier = {
            name: tokens - before.prefix_hits_by_tier.get(name, 0)
            for name, tokens in after.prefix_hits_by_tier.items()
        }
        for name, tokens in by_tier.items():
            if tokens:
                event(f"hits from {name}")
        if after.preemptions != before.preemptions:
            event("preempted")
        if after.preemptions == before.preemptions:
            reused = after.prefix_hits_tokens - before.prefix_hits_tokens
            assert reused == sum(r.cached_tokens for r in requests) == sum(by_tier.values())

    def between_steps(self, data: st.DataObject) -> None:
        engine = self.engine
        action = data.draw(st.sampled_from(["none", "none", "defrag", "pool", "host", "disk"]))
        if action == "defrag":
            moved = engine.defragmenter.run(DefragTrigger.MANUAL, data.draw(st.integers(1, 8)))
            if moved.pages_moved:
                event("defragmented")
        elif action == "pool":
            with contextlib.suppress(ResizeRefused):
                result = engine.resizer.resize(data.draw(st.sampled_from([2, 3, 4, 6])) * SEGMENT)
                event(f"pool {result.direction}")
        elif action in ("host", "disk"):
            self.resize_tier(action, data.draw(st.sampled_from([0, 2, 6, 12])))

    def resize_tier(self, name: str, pages: int) -> None:
        tier = self.tiers.tier(name)
        self.tiers.resize(name, pages * tier.page_bytes)
        assert tier.index.capacity == pages

    @rule(name=st.sampled_from(["host", "disk"]), pages=st.sampled_from([0, 2, 6, 12, 20]))
    def resize_a_tier(self, name: str, pages: int) -> None:
        self.resize_tier(name, pages)

    @rule(name=st.sampled_from(["host", "disk"]), policy=st.sampled_from(["lru", "lfu", "fifo"]))
    def tier_policy(self, name: str, policy: str) -> None:
        self.tiers.set_policy(name, policy)

    @rule()
    def clear_the_device(self) -> None:
        """Every cached page leaves the device at once (into the tiers)."""
        assert self.engine.prefix_cache is not None
        self.engine.prefix_cache.clear()

    @invariant()
    def check(self) -> None:
        engine = self.engine
        engine.pool.invariants.check()
        assert engine.prefix_cache is not None
        engine.prefix_cache.check()
        self.tiers.check()
        stats = engine.stats
        by_tier = stats.prefix_hits_by_tier
        assert sum(by_tier.values()) == stats.prefix_hits_tokens <= stats.prefix_queries_tokens
        assert by_tier["device"] == engine.prefix_cache.hits_tokens >= 0
        for tier in stats.tiers:
            c = tier.counters
            assert c.hits_tokens == c.loaded_pages * PAGE == by_tier[tier.name]
            assert tier.used_pages <= tier.capacity_pages
            assert sum(c.load_failures.values()) == 0
        self.tiers.flush()  # files are written in the background
        disk = self.tiers.tier("disk").index
        files = {p.name for p in self.dir.iterdir()}
        assert files == {f"{d.hex()}.kvpage" for d in disk.entries}


EngineTierMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=20, deadline=None
)
TestEngineTierMachine = EngineTierMachine.TestCase
