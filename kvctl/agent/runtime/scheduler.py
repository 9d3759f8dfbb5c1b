"""Continuous batching: which requests run in the next step, and who yields when pages run out.

Requests join and leave between steps. A step is either a *prefill* (newly admitted requests
compute their prompts; admission stops at the first request that does not fit, so arrival order
is kept) or a *decode* (every running request adds one token). When the pool cannot give a
running request its next page, the youngest running request is preempted: its pages are freed
and it goes back to the front of the queue, to be recomputed later. Preempting the youngest
loses the least work, and nothing ever crashes or touches another request's pages.

Liveness, the rule every step keeps: cached prefix pages count as free for admission (they are
evicted on demand), and the engine refuses at arrival any request whose prompt plus `max_tokens`
could not fit the whole pool, and refuses any shrink below what an admitted request may need.
So the request at the head of the queue always fits once the running requests have finished
(or been preempted), and they always move: every decode step either gives each running request
its token or preempts the youngest. A head that fits only by giving up the partly matched last
page of its cached prefix (whose copy needs one page more) gives it up rather than wait.

With a prefix cache, admission first looks the request's tokens up: a hit adopts the cached
pages (a partly matched last page is copied, the copy listed in the batch) and only the rest is
computed. A request's computed whole pages enter the cache when it finishes or is preempted, so a
preempted request usually finds its own pages again instead of recomputing them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvctl.agent.pool import PagePool, PoolExhausted
from kvctl.agent.pool.page_pool import CopyOnWrite
from kvctl.agent.prefix import IsolationKey, PrefixCache, PrefixMatch
from kvctl.agent.runtime.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class ScheduledBatch:
    """The requests of one step, with the tokens each computes and the page copies to apply.

    `ended` lists requests the scheduler had to stop because they no longer fit the whole pool
    even alone (finish reason "capacity", which the engine's admission and resize rules keep
    from happening); they are not part of the step.
    """

    requests: list[Request]
    new_tokens: list[int]
    is_prefill: bool
    copies: list[CopyOnWrite]
    ended: list[Request]


class Scheduler:
    """Owns the waiting queue and the running set, and the pages each running request holds."""

    def __init__(
        self,
        pool: PagePool,
        max_batch_seqs: int = 64,
        max_batch_tokens: int = 4096,
        prefix_cache: PrefixCache | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_batch_seqs < 1 or max_batch_tokens < 1:
            raise ValueError("max_batch_seqs and max_batch_tokens must be at least 1")
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.max_batch_seqs = max_batch_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the youngest is last
        self.preemptions = 0
        self.clock = clock

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
        batch = self._admit(ended) or self._decode(ended)
        if batch is None and ended:
            return ScheduledBatch([], [], False, [], ended)
        return batch

    def _end_unfittable(self) -> list[Request]:
        """Stop waiting requests that could not fit even in an empty pool."""
        ended = []
        while self.waiting and self.pool.pages_for(self.waiting[0].num_tokens + 1) > (
            self.pool.capacity
        ):
            request = self.waiting.popleft()
            request.status = RequestStatus.FINISHED
            self._end_for_capacity(request)
            ended.append(request)
        return ended

    def _end_for_capacity(self, request: Request) -> None:
        request.finish_reason = FinishReason.CAPACITY
        request.finish_detail = (
            f"the request needs {self.pool.pages_for(request.num_tokens + 1)} pages to go on "
            f"and the pool holds {self.pool.capacity}; it ended after "
            f"{len(request.output_ids)} tokens"
        )

    def _admit(self, ended: list[Request]) -> ScheduledBatch | None:
        admitted: list[Request] = []
        new_tokens: list[int] = []
        copies: list[CopyOnWrite] = []
        budget = self.max_batch_tokens
        while self.waiting and len(self.running) < self.max_batch_seqs:
            request = self.waiting[0]
            tokens = request.num_tokens
            match = self._match(request)
            if match is not None and not self._fits(tokens, match):
                match = self._whole_pages_match(request, match)
            new = tokens - (match.tokens if match else 0)
            if admitted and new > budget:
                break
            if not self._fits(tokens, match):
                break
            self.waiting.popleft()
            copies.extend(self._place(request, match))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(request)
            new_tokens.append(new)
            budget -= new
        if not admitted:
            return None
        return ScheduledBatch(admitted, new_tokens, True, copies, ended)

    def _match(self, request: Request) -> PrefixMatch | None:
        if self.prefix_cache is None:
            return None
        return self.prefix_cache.match(self._cache_key(request), request.token_ids)

    def _whole_pages_match(self, request: Request, match: PrefixMatch) -> PrefixMatch:
        """The match without its partly matched last page, whose copy needs a page more."""
        assert self.prefix_cache is not None
        whole = match.full_pages * self.pool.page_size
        if whole == match.tokens:
            return match
        return self.prefix_cache.match(self._cache_key(request), request.token_ids[: whole + 1])

    def _fits(self, tokens: int, match: PrefixMatch | None) -> bool:
        """Whether the pages a request needs are there, keeping one page per running request for
        its next token so that admitting does not immediately force a preemption."""
        reserve = len(self.running)
        if match is None:
            return self.pool.pages_for(tokens) + reserve <= self.pool.available_pages()
        assert self.prefix_cache is not None
        needed = self.pool.pages_for(tokens) - match.full_pages
        return needed + reserve <= self.pool.free_pages + self.prefix_cache.evictable_pages(match)

    def _place(self, request: Request, match: PrefixMatch | None) -> list[CopyOnWrite]:
        """Give an admitted request its page table: adopted cached pages, then fresh ones."""
        tokens = request.num_tokens
        if match is None or not match.tokens:
            self.pool.allocate(request.seq_id, tokens)
            copies = []
        else:
            _, copies = self.pool.adopt(request.seq_id, match.pages, match.tokens, tokens)
        request.num_computed = match.tokens if match else 0
        if request.first_admitted_at is None:
            request.first_admitted_at = self.clock()
        if match is not None:
            assert self.prefix_cache is not None
            self.prefix_cache.pin([c.src for c in copies])
            self.prefix_cache.record(match, tokens)
            if not request.preemptions:
                request.cached_tokens = match.tokens
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

    def _cache_computed(self, request: Request) -> None:
        """Offer a running request's computed whole pages to the prefix cache (before they are
        freed, so the cache can hold them)."""
        if self.prefix_cache is None:
            return
        table = self.pool.table(request.seq_id)
        computed = min(request.num_computed, table.num_tokens)
        self.prefix_cache.insert(
            self._cache_key(request), request.token_ids[:computed], table.pages
        )

    def _decode(self, ended: list[Request]) -> ScheduledBatch | None:
        scheduled: list[Request] = []
        copies: list[CopyOnWrite] = []
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            while True:
                try:
                    copies.extend(self.pool.append(request.seq_id, 1))
                except PoolExhausted:  # counted as a failed allocation by the pool
                    if self._make_room(request, ended):
                        continue
                    break
                scheduled.append(request)
                break
        if not scheduled:
            return None
        return ScheduledBatch(scheduled, [1] * len(scheduled), False, copies, ended)

    def _make_room(self, request: Request, ended: list[Request]) -> bool:
        """Preempt the youngest running request so `request` can grow; False when `request`
        itself was preempted, or ended because it cannot fit even alone."""
        if self.running == [request]:  # alone and still no room: the pool is too small
            self.finish(request)
            self._end_for_capacity(request)
            ended.append(request)
            return False
        victim = self.running[-1]
        self.preempt(victim)
        return victim is not request

    def preempt(self, request: Request) -> None:
        """Free a running request's pages and queue it first for recomputation."""
        self.running.remove(request)
        self._cache_computed(request)
        self.pool.free(request.seq_id)
        request.status = RequestStatus.WAITING
        request.num_computed = 0
        request.preemptions += 1
        request.queued_at = self.clock()
        self.preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Drop a finished (or aborted) request and free its pages."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._cache_computed(request)
            self.pool.free(request.seq_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
