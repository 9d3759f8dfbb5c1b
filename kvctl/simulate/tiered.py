"""`kvctl simulate --scenario tiered-prefix`: multi-turn chat on a device pool that holds about a
quarter of the conversations' KV, run without and with a host tier below it.

What is real and what is modelled:

- **Real**: the agent's own `Scheduler` (admission, chunked prefill, preemption), `PagePool`,
  `PrefixCache` (radix tree, LRU eviction) and `TieredStore` over a `KVStorage`, wired as the
  engine wires them (`prefix_cache.spill = tiers.store_many`, the scheduler looks prompts up in the
  tiers and fetches hits into the request's pages). Pages are stored into the host tier when the
  device evicts them and loaded back at admission, byte for byte, through the same code paths.
- **Modelled**: the model. A step applies the batch's copy-on-write copies and tier loads to
  storage, advances every request by its tokens as the engine does, and "samples" the next
  token of the turn's scripted reply; no forward pass runs, so K/V contents are zeros and the
  storage layout is the smallest one (one layer, one head of one dimension). Time is in steps.
- **The trace**: `conversations` chats share a system prompt; each has `turns` turns, and turn
  k's prompt is the whole conversation so far (system prompt, earlier user messages and replies)
  plus a new user message of 32–160 tokens; replies are 32–128 tokens. At most `concurrency`
  turns run at once; each free slot goes to a conversation drawn at random among those whose
  previous turn has finished, so a conversation comes back after many others have passed
  through the device, as users who think between turns do. One `random.Random(seed)` draws it.
- **Sizes**: the *working set* is the distinct pages of every conversation's final context
  (the system prompt once). The device pool holds `budget_fraction` of it (default 0.25, never
  less than the largest turn); the host tier, when there is one, `host_fraction` (default 1.0).

Reported per side: the effective prefix hit rate (reused ÷ looked-up prompt tokens), its part
from each tier, what an unbounded cache would have reused (`ideal_hit_rate`), the prompt tokens
computed, preemptions and the pages the tiers stored and loaded.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from kvctl.agent.model.sampling import SamplingParams
from kvctl.agent.pool import PagePool
from kvctl.agent.pool.storage import KVStorage
from kvctl.agent.prefix import PrefixCache
from kvctl.agent.runtime.request import FinishReason, Request
from kvctl.agent.runtime.scheduler import Scheduler
from kvctl.agent.tiers import TieredStore
from kvctl.simulate.names import TIERED

SIDES = ("device only", "device + host")
SYSTEM_TOKENS = 64
USER_TOKENS = (32, 160)
REPLY_TOKENS = (32, 128)
VOCAB = 32_000
SEGMENT_PAGES = 16

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class TieredConfig:
    """Knobs of the tiered run; the defaults are what `kvctl simulate` uses."""

    requests: int | None = None
    """Turns in all (`turns` per conversation); default 288: 48 conversations of 6 turns."""
    budget_fraction: float | None = None
    """The device pool as a share of the working set; default 0.25."""
    page_size: int = 16
    turns: int = 6
    concurrency: int = 4
    host_fraction: float = 1.0
    """The host tier as a share of the working set."""
    max_batched_tokens: int = 512
    max_steps: int = 1_000_000

    def __post_init__(self) -> None:
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be at least 1, got {self.requests}")
        if self.budget_fraction is not None and not 0 < self.budget_fraction <= 1:
            raise ValueError(f"budget_fraction must be in (0, 1], got {self.budget_fraction}")
        for name in ("page_size", "turns", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.host_fraction <= 0:
            raise ValueError("host_fraction must be above 0")


DEFAULT_REQUESTS = 288
DEFAULT_FRACTION = 0.25


@dataclass(frozen=True)
class Turn:
    """One turn: its conversation, its prompt (the conversation so far plus the new message)
    and the reply the model will give."""

    conversation: int
    index: int
    prompt: tuple[int, ...]
    reply: tuple[int, ...]


def build_trace(seed: int, conversations: int, turns: int) -> list[list[Turn]]:
    """Each conversation's turns, in order; a seed names one trace."""
    rng = random.Random(seed)

    def tokens(low: int, high: int) -> tuple[int, ...]:
        return tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(low, high)))

    system = tuple(rng.randrange(1, VOCAB) for _ in range(SYSTEM_TOKENS))
    trace = []
    for c in range(conversations):
        history = system
        chat = []
        for k in range(turns):
            prompt = history + tokens(*USER_TOKENS)
            reply = tokens(*REPLY_TOKENS)
            chat.append(Turn(c, k, prompt, reply))
            history = prompt + reply
        trace.append(chat)
    return trace


def working_set_pages(trace: list[list[Turn]], page_size: int) -> int:
    """Distinct pages of every conversation's final context, the shared system prompt once."""
    shared = SYSTEM_TOKENS // page_size
    return shared + sum(
        math.ceil((len(chat[-1].prompt) + len(chat[-1].reply)) / page_size) - shared
        for chat in trace
    )


def ideal_hits(trace: list[list[Turn]]) -> int:
    """Prompt tokens an unbounded cache would reuse: a first turn its system prompt (once some
    conversation has computed it), a later one the conversation so far (the previous reply's
    last token has no K/V: it was sampled, never computed), up to all but its last token."""
    hits = 0
    for chat in trace:
        for turn in chat:
            known = SYSTEM_TOKENS
            if turn.index:
                previous = chat[turn.index - 1]
                known = len(previous.prompt) + len(previous.reply) - 1
            hits += min(known, len(turn.prompt) - 1)
    return hits - min(SYSTEM_TOKENS, len(trace[0][0].prompt) - 1)  # the first computes it


class TieredRun:
    """One side: the agent's scheduler, pool, prefix cache and (optionally) host tier."""

    def __init__(
        self,
        trace: list[list[Turn]],
        device_pages: int,
        host_pages: int,
        config: TieredConfig,
        name: str,
    ) -> None:
        self.trace = trace
        self.turns = {f"c{t.conversation}t{t.index}": t for chat in trace for t in chat}
        self.name = name
        self.config = config
        segments = -(-device_pages // SEGMENT_PAGES)
        self.storage = KVStorage(segments, SEGMENT_PAGES, config.page_size, 1, 1, 1)
        self.pool = PagePool(
            segments * SEGMENT_PAGES, config.page_size, SEGMENT_PAGES, self.storage.bytes_per_page
        )
        self.prefix_cache = PrefixCache(self.pool, "lru", "simulated")
        self.tiers = (
            TieredStore(self.storage, host_pages * self.storage.bytes_per_page)
            if host_pages
            else None
        )
        if self.tiers is not None:
            self.prefix_cache.spill = self.tiers.store_many
        self.scheduler = Scheduler(
            self.pool,
            max_batch_seqs=config.concurrency,
            max_batched_tokens=config.max_batched_tokens,
            prefix_cache=self.prefix_cache,
            clock=lambda: float(self.steps),
            tiers=self.tiers,
        )
        self.steps = 0

    def run(self, seed: int, progress: Callable[[int], None]) -> None:
        """Every turn of the trace to its end, at most `concurrency` at once; `seed` draws
        which ready conversation takes the next free slot."""
        trace = self.trace
        rng = random.Random(seed + 1)
        next_turn = [0] * len(trace)
        ready = list(range(len(trace)))
        running: dict[str, tuple[Request, Turn]] = {}
        done = 0
        while ready or running:
            while ready and len(running) < self.config.concurrency:
                conversation = ready.pop(rng.randrange(len(ready)))
                turn = trace[conversation][next_turn[conversation]]
                request = Request(
                    f"c{conversation}t{turn.index}",
                    list(turn.prompt),
                    SamplingParams(temperature=0, max_tokens=len(turn.reply)),
                    arrival=done + len(running),
                )
                self.scheduler.add(request)
                running[request.request_id] = (request, turn)
            for request, turn in self._step():
                del running[request.request_id]
                done += 1
                progress(done)
                conversation = turn.conversation
                next_turn[conversation] += 1
                if next_turn[conversation] < len(trace[conversation]):
                    ready.append(conversation)

    def _step(self) -> list[tuple[Request, Turn]]:
        """One engine step without the model (see the module docstring); the turns it ended."""
        if self.steps >= self.config.max_steps:
            raise RuntimeError(f"{self.name}: no end after {self.steps} steps")
        self.steps += 1
        batch = self.scheduler.schedule()
        if batch is None:
            raise RuntimeError(f"{self.name}: requests wait but none can run")
        if batch.ended:
            raise RuntimeError(f"{self.name}: a turn no longer fits the device pool")
        if batch.copies:
            self.storage.copy_pages([c.src for c in batch.copies], [c.dst for c in batch.copies])
            self.scheduler.copies_applied()
        for load in batch.loads:
            self.storage.fill_pages(load.pages, load.data)
        sampled = batch.sampled_requests
        for request, count in zip(batch.requests, batch.new_tokens, strict=True):
            request.num_computed += count
        self.scheduler.step_computed(batch)
        ended = []
        for request in sampled:
            request.num_computed = request.num_tokens
            turn = self.turns[request.request_id]
            request.output_ids.append(turn.reply[len(request.output_ids)])
            if len(request.output_ids) == len(turn.reply):
                request.finish_reason = FinishReason.LENGTH
                self.scheduler.finish(request)
                ended.append((request, turn))
        return ended

    def result(self, working_set: int) -> dict[str, Any]:
        """What this side reused, by tier, and what it computed."""
        trace = self.trace
        cache = self.prefix_cache
        queried = cache.queries_tokens
        by_tier = {"device": cache.hits_tokens, "host": 0}
        stored = loaded = 0
        if self.tiers is not None:
            (host, *_) = self.tiers.stats()
            by_tier["host"] = host.counters.hits_tokens
            stored, loaded = host.counters.stored_pages, host.counters.loaded_pages
        hits = sum(by_tier.values())
        prompts = sum(len(turn.prompt) for chat in trace for turn in chat)
        return {
            "turns": sum(len(chat) for chat in trace),
            "conversations": len(trace),
            "prompt_tokens": prompts,
            "queried_tokens": queried,
            "hit_tokens": hits,
            "hit_rate": round(hits / queried, 6) if queried else 0.0,
            "hit_rate_by_tier": {
                tier: round(tokens / queried, 6) if queried else 0.0
                for tier, tokens in by_tier.items()
            },
            "hit_tokens_by_tier": by_tier,
            "ideal_hit_rate": round(ideal_hits(trace) / prompts, 6),
            "computed_prompt_tokens": queried - hits,
            "preemptions": self.scheduler.preemptions,
            "device_evicted_pages": sum(cache.evictions.values()),
            "host_stored_pages": stored,
            "host_loaded_pages": loaded,
            "device_pages": self.pool.capacity,
            "host_pages": self.tiers.tiers[0].index.capacity if self.tiers is not None else 0,
            "working_set_pages": working_set,
            "steps": self.steps,
        }


def _offset(progress: Progress | None, base: int, total: int) -> Callable[[int], None]:
    """`progress` of one side's turns as a count over both sides'."""

    def report(n: int) -> None:
        if progress is not None:
            progress(base + n, total)

    return report


def run_tiered(seed: int, progress: Progress | None = None, **overrides: Any) -> dict[str, Any]:
    """The tiered scenario for `seed`, without and with a host tier, on the same trace.

    `overrides` are `TieredConfig` fields. Returns
    `{"scenario": "tiered-prefix", "seed": seed, "results": {"device only": {...},
    "device + host": {...}}}`."""
    unknown = set(overrides) - {f.name for f in fields(TieredConfig)}
    if unknown:
        raise TypeError(f"unknown simulation settings: {', '.join(sorted(unknown))}")
    config = TieredConfig(**overrides)
    turns = DEFAULT_REQUESTS if config.requests is None else config.requests
    conversations = max(1, turns // config.turns)
    trace = build_trace(seed, conversations, config.turns)
    working_set = working_set_pages(trace, config.page_size)
    fraction = DEFAULT_FRACTION if config.budget_fraction is None else config.budget_fraction
    largest = max(
        math.ceil((len(t.prompt) + len(t.reply) + 1) / config.page_size)
        for chat in trace
        for t in chat
    )
    device_pages = max(math.ceil(fraction * working_set), largest + 1)
    host_pages = math.ceil(config.host_fraction * working_set)
    total = 2 * conversations * config.turns
    results: dict[str, Any] = {}
    for offset, (name, host) in enumerate(zip(SIDES, (0, host_pages), strict=True)):
        side = TieredRun(trace, device_pages, host, config, name)
        base = offset * conversations * config.turns
        side.run(seed, _offset(progress, base, total))
        results[name] = side.result(working_set)
    return {"scenario": TIERED, "seed": seed, "results": results}
