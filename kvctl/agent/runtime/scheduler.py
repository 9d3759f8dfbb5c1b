"""Continuous batching with chunked prefill: which tokens run in the next step, and who yields
when pages run out.

Requests join and leave between steps. Each step computes at most `max_batched_tokens` tokens
(vLLM's V1 policy): first one decode token for every running request whose prompt is computed,
then the rest of partly computed prompts, then newly admitted requests, each prompt cut to what
the budget leaves. So a long prompt is computed in chunks over several steps while the running
requests keep decoding in the same forward passes (mixed steps), and nobody's inter-token gap
waits for a whole prompt. The budget is never below `max_batch_seqs`, so every running request
can decode in every step. While requests decode, long prompts (longer than the budget, so
chunked anyway) take at most `prefill_while_decoding` tokens of a step between them: on a CPU a
prompt token costs a sizeable share of a decode step, so a 256-token chunk would still multiply
the streams' gap. Prompts the budget holds are computed whole as before (a burst of short
requests keeps its throughput), and with nothing decoding a long prompt gets the whole budget.

An admitted request gets the pages of its whole prompt at once and keeps them, and its progress
(`num_computed`), across the steps of its prefill: admission needs exactly what it needed before
chunking, and a chunk never allocates. When the pool cannot give a decoding request its next
page, the youngest running request (often a prompt still being computed) is preempted: its
computed whole pages are offered to the prefix cache, its pages are freed and it goes back to the
front of the queue, to be recomputed later. Preempting the youngest loses the least work, and
nothing ever crashes or touches another request's pages. A step that preempted admits nobody.

Liveness, the rule every step keeps: cached prefix pages count as free for admission (they are
evicted on demand), and the engine refuses at arrival any request whose prompt plus `max_tokens`
could not fit the whole pool, and refuses any shrink below what an admitted request may need.
So the request at the head of the queue always fits once the running requests have finished
(or been preempted), and they always move: every step gives each decoding request its token
(or preempts the youngest) and every partly computed prompt at least one token of budget. A head
that fits only by giving up the partly matched last page of its cached prefix (whose copy needs
one page more) gives it up rather than wait.

With a prefix cache, admission first looks the request's tokens up: a hit adopts the cached
pages (a partly matched last page is copied, the copy listed in the batch) and only the rest is
computed. A request's computed whole pages enter the cache when it finishes or is preempted, so a
preempted request usually finds its own pages again instead of recomputing them.

With tiers below the device (`TieredStore`), the lookup goes on past the device's match: whole
pages a lower tier holds are fetched at admission into the request's own fresh pages (written
before the step's forward, `ScheduledBatch.loads`) and count as computed.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from kvctl.agent.config import DEFAULT_MAX_BATCHED_TOKENS
from kvctl.agent.pool import PagePool, PoolExhausted
from kvctl.agent.pool.page_pool import CopyOnWrite
from kvctl.agent.prefix import IsolationKey, PrefixCache, PrefixMatch
from kvctl.agent.runtime.layer_groups import LayerGroups
from kvctl.agent.runtime.prefix_pins import PrefixPins
from kvctl.agent.runtime.request import FinishReason, Request, RequestStatus
from kvctl.agent.runtime.request_pages import RequestPages
from kvctl.agent.tiers import TieredStore, TierHit


@dataclass(frozen=True)
class TierPages:
    """Pages of an admitted request to fill from a lower tier before the step's forward:
    `data[i]` goes into pool page `pages[i]`."""

    pages: list[int]
    data: Tensor


@dataclass(frozen=True)
class ScheduledBatch:
    """The requests of one step, with the tokens each computes and the page copies to apply.

    Request i computes its tokens `computed[i] : computed[i] + new_tokens[i]`; decoding requests
    come first, then chunks of prompts. `sampled[i]` says whether that reaches the end of its
    tokens, so that a next token is sampled (a chunk short of the end only fills the cache).

    `ended` lists requests the scheduler had to stop because they no longer fit the whole pool
    even alone (finish reason "capacity", which the engine's admission and resize rules keep
    from happening); they are not part of the step.
    """

    requests: list[Request]
    new_tokens: list[int]
    computed: list[int]
    copies: list[CopyOnWrite]
    ended: list[Request]
    loads: list[TierPages] = field(default_factory=list)

    @property
    def sampled(self) -> list[bool]:
        return [
            c + n == r.num_tokens
            for r, c, n in zip(self.requests, self.computed, self.new_tokens, strict=True)
        ]

    @property
    def sampled_requests(self) -> list[Request]:
        """The requests that get a next token from this step, in batch order."""
        return [r for r, done in zip(self.requests, self.sampled, strict=True) if done]

    @property
    def is_prefill(self) -> bool:
        """Whether some request computes more than one token (a prompt or a chunk of one)."""
        return any(n > 1 for n in self.new_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.new_tokens)


class _Step:
    """The batch being built: requests, their token counts, copies, and the budget left."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.long_budget = budget  # what long prompts may still take (capped while decoding)
        self.requests: list[Request] = []
        self.new_tokens: list[int] = []
        self.computed: list[int] = []
        self.copies: list[CopyOnWrite] = []
        self.loads: list[TierPages] = []
        self.scheduled: set[Request] = set()

    def add(self, request: Request, tokens: int) -> None:
        self.scheduled.add(request)
        self.requests.append(request)
        self.new_tokens.append(tokens)
        self.computed.append(request.num_computed)
        self.budget -= tokens

    def batch(self, ended: list[Request]) -> ScheduledBatch | None:
        if not self.requests:
            return ScheduledBatch([], [], [], [], ended) if ended else None
        return ScheduledBatch(
            self.requests, self.new_tokens, self.computed, self.copies, ended, self.loads
        )


PREEMPTION_REASONS = ("growth", "pool_too_small", "shrink")
"""Why a running request lost its pages: another running request needed a page to grow (the
youngest goes); it was alone and the pool cannot hold it until the pool grows (a shared budget);
the pool shrank (an operator's resize, or the budget moving memory to another pool)."""


class Scheduler:
    """Owns the waiting queue and the running set, and the pages each running request holds."""

    def __init__(
        self,
        pool: PagePool,
        max_batch_seqs: int = 64,
        max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
        prefix_cache: PrefixCache | None = None,
        clock: Callable[[], float] = time.monotonic,
        prefill_while_decoding: int = 0,
        tiers: TieredStore | None = None,
        long_prompt_tokens: int | None = None,
        groups: LayerGroups | None = None,
    ):
        check_batch_limits(max_batch_seqs, max_batched_tokens)
        if prefill_while_decoding < 0:
            raise ValueError("prefill_while_decoding must be 0 (no cap) or more")
        if long_prompt_tokens is not None and long_prompt_tokens < 1:
            raise ValueError("long_prompt_tokens must be 1 or more")
        self.prefill_while_decoding = prefill_while_decoding
        # more tokens than this left to compute make a prompt long; one the budget cannot hold
        # in a step always is
        self.long_prompt_tokens = min(long_prompt_tokens or max_batched_tokens, max_batched_tokens)
        self.pool = pool
        self.pages = RequestPages(pool, groups)
        self.pins = PrefixPins(self.pages)  # pinned prefixes hold pages as requests do
        self.prefix_cache = prefix_cache
        self.tiers = tiers if prefix_cache is not None else None
        self.tier_min_load_tokens = 0  # shorter hits below the device are computed instead
        self.max_batch_seqs = max_batch_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the youngest is last
        self.preemptions = 0
        self.preemptions_by_reason: Counter[str] = Counter({r: 0 for r in PREEMPTION_REASONS})
        self.window_released = 0  # pages sliding windows gave back while their requests ran
        self.clock = clock
        # The most pages a shared KV budget may still give the pool (None: its capacity is all)
        self.reachable_pages: Callable[[], int] | None = None

    def most_pages(self) -> int:
        """The most pages a request may count on: the pool's capacity, or more when it shares
        a budget whose other pools could give it memory (the request then waits while the
        agent moves it, instead of being refused or ended), less the pages pins hold."""
        capacity = self.pool.capacity
        if self.reachable_pages is not None:
            capacity = max(capacity, self.reachable_pages())
        return capacity - self.pins.pinned_pages

    def add(self, request: Request) -> None:
        request.queued_at = request.arrived_at = self.clock()
        self.waiting.append(request)

    def oldest_queued_at(self) -> float | None:
        """When the request waiting longest entered the queue (a preempted one re-enters)."""
        return min((r.queued_at for r in self.waiting), default=None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch, or None when nothing can run."""
        ended = self._end_unfittable()
        step = _Step(self.max_batched_tokens)
        preempted = self.preemptions
        self._decode(step, ended)
        if step.requests and self.prefill_while_decoding:
            step.long_budget = self.prefill_while_decoding
        self._continue_prefills(step)
        if self.preemptions == preempted:
            self._admit(step)
        return step.batch(ended)

    def _end_unfittable(self) -> list[Request]:
        """Stop waiting requests that could not fit even in an empty pool."""
        ended = []
        while self.waiting and self.pages.pages_for(self.waiting[0].num_tokens + 1) > (
            self.most_pages()
        ):
            request = self.waiting.popleft()
            request.status = RequestStatus.FINISHED
            self._end_for_capacity(request)
            ended.append(request)
        return ended

    def _end_for_capacity(self, request: Request) -> None:
        request.finish_reason = FinishReason.CAPACITY
        request.finish_detail = (
            f"the request needs {self.pages.pages_for(request.num_tokens + 1)} pages to go on "
            f"and the pool holds {self.pool.capacity}{self.pinned_note()}; it ended after "
            f"{len(request.output_ids)} tokens"
        )

    def pinned_note(self) -> str:
        """', N of them pinned prefixes' after a pool size, when pins hold pages."""
        pinned = self.pins.pinned_pages
        return f", {pinned} of them pinned prefixes (kvctl prefix ls)" if pinned else ""

    def _admit(self, step: _Step) -> None:
        """Admit waiting requests in arrival order while they fit, each computing as much of its
        prompt as the budget leaves. A request that needs more pages than the pool holds waits
        for it to grow (memory from a shared budget) without holding up those behind it; once
        the pool holds it, it is first again and nobody passes it, so it is not starved."""
        passed = 0  # requests at the head that wait for the pool to grow
        while (
            len(self.waiting) > passed
            and len(self.running) < self.max_batch_seqs
            and step.budget > 0
        ):
            request = self.waiting[passed]
            tokens = request.num_tokens
            matches, below = self._match(request)
            if matches is not None and not self._fits(tokens, matches):
                matches = self.whole_pages(request.token_ids, matches)
            if not self._fits(tokens, matches):
                if self._waits_for_growth(request):
                    passed += 1
                    continue
                break
            cached = 0 if matches is None else matches[0].tokens  # what `_chunk` counts from
            if self._is_long(tokens - cached) and step.long_budget <= 0:
                break  # a long prompt waits for a step with room for it (arrival order kept)
            del self.waiting[passed]
            step.copies.extend(self._place(request, matches))
            if below is not None:
                self._load(request, below, step)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.add(request, self._chunk(request, tokens - request.num_computed, step))

    def window_pages(self) -> int:
        """Pages the running requests' sliding-window groups hold now."""
        return len(self.window_page_ids())

    def window_page_ids(self) -> set[int]:
        """The pages the running requests' sliding-window groups hold now."""
        sliding = self.pages.groups.sliding
        if not sliding:
            return set()
        return {
            page
            for tables in (self.pages.tables(r.seq_id) for r in self.running)
            for g in sliding
            for page in tables[g].pages
        }

    def _waits_for_growth(self, request: Request) -> bool:
        """Whether the request needs more pages than the pool holds, so that nothing finishing
        in it could make room: only a larger pool can."""
        return self.pages.pages_for(request.num_tokens + 1) > self.pool.capacity

    def preempt_to_fit(self, pages: int) -> int:
        """Preempt the youngest running requests until at most `pages` pages are in use, for a
        shrink that must give memory back; how many were preempted."""
        preempted = 0
        while self.running and self.pool.used_pages > pages:
            self.preempt(self.running[-1], "shrink")
            preempted += 1
        return preempted

    def _match(self, request: Request) -> tuple[list[PrefixMatch] | None, list[TierHit] | None]:
        """The device's longest cached prefix, in each page group's partition (as long in
        each: what all of them hold), and the whole pages after it that a lower tier holds for
        every group (the device match then ends on a page boundary: those pages come next)."""
        if self.prefix_cache is None:
            return None, None
        keys, tokens = self._cache_keys(request), request.token_ids
        matches = self._common(tokens, [self.prefix_cache.match(k, tokens) for k in keys])
        if self.tiers is None:
            return matches, None
        last = (len(tokens) - 1) // self.pool.page_size
        hits = [
            self.tiers.lookup(key, tokens, match.full_pages, last)
            for key, match in zip(keys, matches, strict=True)
        ]
        found = min((0 if hit is None else hit.pages) for hit in hits)
        if not found or found * self.pool.page_size < self.tier_min_load_tokens:
            return matches, None
        below = [TierHit(hit.first_page, hit.digests[:found]) for hit in hits if hit is not None]
        return self.whole_pages(request.token_ids, matches), below

    def prefix_matches(
        self, salt: str | None, token_ids: Sequence[int], limit: int
    ) -> list[PrefixMatch]:
        """The device's longest cached prefix of `token_ids`, at most `limit` tokens, in the
        partitions of cache salt `salt` (one per page group, as long in each): what a lookup
        reports and a pin holds. Partitions with sampling settings are not looked up."""
        cache = self.prefix_cache
        assert cache is not None
        keys = self._group_keys(cache.key_for(salt))
        return self._common(token_ids, [cache.match(k, token_ids, limit) for k in keys])

    def _common(self, token_ids: Sequence[int], matches: list[PrefixMatch]) -> list[PrefixMatch]:
        """Each group's match cut to one length that all of them hold. A sliding group's match
        cut shorter may be shorter still (the window of the shorter prefix reaches pages of its
        own), so this goes on until the lengths agree."""
        cache = self.prefix_cache
        assert cache is not None
        while True:
            tokens = min(match.tokens for match in matches)
            if all(match.tokens == tokens for match in matches):
                return matches
            matches = [
                m if m.tokens == tokens else cache.match(m.key, token_ids, tokens) for m in matches
            ]

    def _load(self, request: Request, below: list[TierHit], step: _Step) -> None:
        """Fetch a lower tier's pages of an admitted request into its own pages (written before
        the forward): those tokens count as computed, and as reused from their tier."""
        assert self.tiers is not None
        loads = [self.tiers.fetch(hit, count_tokens=not g) for g, hit in enumerate(below)]
        count = min((0 if load is None else load.pages) for load in loads)
        if not count:
            return
        for table, load in zip(self.pages.tables(request.seq_id), loads, strict=True):
            assert load is not None
            first = load.first_page
            pages = table.positional()[first : first + count]
            step.loads.append(TierPages(pages, load.data[:count]))
        loaded = count * self.pool.page_size
        request.num_computed += loaded
        request.admitted_computed += loaded
        if not request.preemptions:
            request.cached_tokens += loaded

    def whole_pages(
        self, token_ids: Sequence[int], matches: list[PrefixMatch]
    ) -> list[PrefixMatch]:
        """The matches without their partly matched last page (whose copy needs a page more;
        a pin holds whole pages only)."""
        assert self.prefix_cache is not None
        whole = matches[0].full_pages * self.pool.page_size
        if whole == matches[0].tokens:
            return matches
        return [self.prefix_cache.match(match.key, token_ids, whole) for match in matches]

    def _fits(self, tokens: int, matches: list[PrefixMatch] | None) -> bool:
        """Whether the pages a request needs are there, keeping a page per running request and
        page table for its next token so that admitting does not immediately force a
        preemption."""
        reserve = len(self.running) * self.pages.count
        if matches is None:
            return self.pages.pages_for(tokens) + reserve <= self.pool.available_pages()
        assert self.prefix_cache is not None
        needed = self.pages.pages_for(tokens) - sum(match.full_pages for match in matches)
        evictable = self.prefix_cache.evictable_pages(*matches)
        return needed + reserve <= self.pool.free_pages + evictable

    def _place(self, request: Request, matches: list[PrefixMatch] | None) -> list[CopyOnWrite]:
        """Give an admitted request its page tables: adopted cached pages, then fresh ones."""
        tokens = request.num_tokens
        hit = 0 if matches is None else matches[0].tokens
        copies: list[CopyOnWrite] = []
        if not hit:
            self.pages.allocate(request.seq_id, tokens)
        else:
            assert matches is not None
            shared = [(match.pages, match.tokens, match.dropped) for match in matches]
            copies = self.pages.adopt(request.seq_id, shared, tokens)
        request.num_computed = request.admitted_computed = hit
        if request.first_admitted_at is None:
            request.first_admitted_at = self.clock()
        if matches is not None:
            assert self.prefix_cache is not None
            self.prefix_cache.pin([c.src for c in copies])
            self.prefix_cache.record(matches[0], tokens)
            for match in matches[1:]:
                self.prefix_cache.mark_used(match)
            if not request.preemptions:
                request.cached_tokens = hit
        return copies

    def copies_applied(self) -> None:
        """Storage holds the last batch's copies: their sources may be evicted again."""
        if self.prefix_cache is not None:
            self.prefix_cache.unpin_all()

    def _cache_key(self, request: Request) -> IsolationKey:
        assert self.prefix_cache is not None
        params = request.params
        sampling = (params.temperature, params.top_p, params.top_k, params.seed)
        return self.prefix_cache.key_for(request.cache_salt, sampling)

    def _cache_keys(self, request: Request) -> list[IsolationKey]:
        """The request's partition in each page group (one group: its own key)."""
        return self._group_keys(self._cache_key(request))

    def _group_keys(self, key: IsolationKey) -> list[IsolationKey]:
        """`key`'s partition in each page group (one group: `key` itself)."""
        if not self.pages.groups.split:
            return [key]
        return [dataclasses.replace(key, group=g) for g in range(self.pages.count)]

    def _cache_computed(self, request: Request, own_only: bool = False) -> None:
        """Offer a running request's computed whole pages to the prefix cache (before they are
        freed, so the cache can hold them). `own_only`: in a tree, only where the cache's pages
        for those tokens, if any, are the request's own (see `step_computed`); a sliding
        group's pages are held one by one, so none of them can hang above another."""
        if self.prefix_cache is None:
            return
        cache = self.prefix_cache
        tables = self.pages.tables(request.seq_id)
        for key, table in zip(self._cache_keys(request), tables, strict=True):
            tokens = request.token_ids[: min(request.num_computed, table.num_tokens)]
            if cache.window_of(key) is not None:
                cache.insert(key, tokens, table.positional(), table.dropped)
                continue
            if own_only:
                match = cache.match(key, tokens)
                whole = match.full_pages
                if match.pages[:whole] != table.pages[:whole]:
                    continue
            cache.insert(key, tokens, table.pages)

    def _decode(self, step: _Step, ended: list[Request]) -> None:
        """One token for every running request whose prompt is computed: the page for its last
        sampled token, preempting the youngest when the pool has none."""
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or not self._decoding(request):
                continue  # preempted earlier in this loop, or still computing its prompt
            while True:
                try:
                    step.copies.extend(self.pages.grow_to(request.seq_id, request.num_tokens))
                except PoolExhausted:  # counted as a failed allocation by the pool
                    if self._make_room(request, ended):
                        continue
                    break
                step.add(request, 1)
                break

    def _decoding(self, request: Request) -> bool:
        """Whether the request's last token (just sampled) has no slot yet: it decodes. A prompt
        being computed holds the slots of all its tokens since admission."""
        return self.pages.tokens_held(request.seq_id) < request.num_tokens

    def _continue_prefills(self, step: _Step) -> None:
        """The next chunk of every partly computed prompt, oldest first, as the budget allows."""
        for request in self.running:
            if step.budget <= 0:
                return
            left = request.num_tokens - request.num_computed
            if left and request not in step.scheduled:
                chunk = self._chunk(request, left, step)
                if chunk:
                    step.add(request, chunk)

    def _is_long(self, to_compute: int) -> bool:
        """Whether a prompt with `to_compute` tokens beyond what its admission found computed
        is long. Admission and chunking both count from that admission (a preempted request
        is judged by what its return found cached, not by its first admission), so a request
        admitted as short is never then given no tokens as long."""
        return to_compute > self.long_prompt_tokens

    def _chunk(self, request: Request, left: int, step: _Step) -> int:
        """How much of a prompt this step computes: what the budget leaves, and for a long
        prompt (more than `long_prompt_tokens` beyond what it found computed) at most what is
        left of the cap while requests decode, so it is spread over steps instead of stalling
        their streams."""
        chunk = min(left, step.budget)
        if self._is_long(request.num_tokens - request.admitted_computed):
            chunk = min(chunk, step.long_budget)
            step.long_budget -= chunk
        return chunk

    def _make_room(self, request: Request, ended: list[Request]) -> bool:
        """Preempt the youngest running request so `request` can grow; False when `request`
        itself was preempted, or ended because it cannot fit even alone."""
        if self.running == [request]:  # alone and still no room: the pool is too small
            if self.pages.pages_for(request.num_tokens + 1) <= self.most_pages():
                self.preempt(request, "pool_too_small")  # its pool may yet grow: wait for it
                return False
            self.finish(request)
            self._end_for_capacity(request)
            ended.append(request)
            return False
        victim = self.running[-1]
        self.preempt(victim, "growth")
        return victim is not request

    def step_computed(self, batch: ScheduledBatch) -> None:
        """After a step's forward: offer the whole pages that its prompt chunks completed to the
        prefix cache at once, not when their requests end (requests admitted in the next steps
        with the same prefix, a shared system prompt arriving in a burst, adopt them instead of
        computing them again); then the sliding groups give back the pages their window has
        left, so a prompt's pages enter the cache before they go.

        Pages are offered only in the groups where the cache's pages for the request's computed
        tokens, if any, are its own. If another request computed the same prefix at the same
        time, offering these pages now would hang them in use below that one's (an unused
        cached page above a used one, which leaf-first eviction cannot reach); they are offered
        when the request ends instead."""
        if self.prefix_cache is not None:
            page = self.pool.page_size
            for request, start, count in zip(
                batch.requests, batch.computed, batch.new_tokens, strict=True
            ):
                prompt = len(request.prompt_ids)
                if start < prompt and min(start + count, prompt) // page > start // page:
                    self._cache_computed(request, own_only=True)
        if self.pages.groups.releases:
            for request in batch.requests:
                released = self.pages.release_window(request.seq_id, request.num_computed)
                self.window_released += released

    def share_computed(self, request: Request) -> None:
        """Offer a running request's computed whole pages to the prefix cache now, so that
        requests queued after it with the same prompt (its other choices) adopt them."""
        if request.status is RequestStatus.RUNNING:
            self._cache_computed(request)

    def preempt(self, request: Request, reason: str = "growth") -> None:
        """Free a running request's pages and queue it first for recomputation; `reason`
        (PREEMPTION_REASONS) is counted."""
        self.running.remove(request)
        self._cache_computed(request)
        self.pages.free(request.seq_id)
        request.status = RequestStatus.WAITING
        request.num_computed = 0
        request.preemptions += 1
        request.queued_at = self.clock()
        self.preemptions += 1
        self.preemptions_by_reason[reason] += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Drop a finished (or aborted) request and free its pages."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._cache_computed(request)
            self.pages.free(request.seq_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED


def check_batch_limits(max_batch_seqs: int, max_batched_tokens: int) -> None:
    """Refuse a budget below the number of running requests: every one must decode each step."""
    if max_batch_seqs < 1:
        raise ValueError(f"max_batch_seqs must be at least 1, got {max_batch_seqs}")
    if max_batched_tokens < max_batch_seqs:
        raise ValueError(
            f"max_batched_tokens ({max_batched_tokens}) must be at least max_batch_seqs "
            f"({max_batch_seqs}): every running request decodes one token in every step"
        )
