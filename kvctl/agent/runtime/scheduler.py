"""Continuous batching: which requests run in the next step, and who yields when pages run out.

Requests join and leave between steps. A step is either a *prefill* (newly admitted requests
compute their prompts; admission stops at the first request that does not fit, so arrival order
is kept) or a *decode* (every running request adds one token). When the pool cannot give a
running request its next page, the youngest running request is preempted: its pages are freed
and it goes back to the front of the queue, to be recomputed later. Preempting the youngest
loses the least work, and nothing ever crashes or touches another request's pages.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvctl.agent.pool import PagePool
from kvctl.agent.pool.page_pool import CopyOnWrite
from kvctl.agent.runtime.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class ScheduledBatch:
    """The requests of one step, with the tokens each computes and the page copies to apply.

    `ended` lists requests the scheduler had to stop because they cannot fit the whole pool
    even alone (finish reason "length"); they are not part of the step.
    """

    requests: list[Request]
    new_tokens: list[int]
    is_prefill: bool
    copies: list[CopyOnWrite]
    ended: list[Request]


class Scheduler:
    """Owns the waiting queue and the running set, and the pages each running request holds."""

    def __init__(self, pool: PagePool, max_batch_seqs: int = 64, max_batch_tokens: int = 4096):
        if max_batch_seqs < 1 or max_batch_tokens < 1:
            raise ValueError("max_batch_seqs and max_batch_tokens must be at least 1")
        self.pool = pool
        self.max_batch_seqs = max_batch_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the youngest is last
        self.preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

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
            request.finish_reason = FinishReason.LENGTH
            ended.append(request)
        return ended

    def _admit(self, ended: list[Request]) -> ScheduledBatch | None:
        admitted: list[Request] = []
        new_tokens: list[int] = []
        budget = self.max_batch_tokens
        while self.waiting and len(self.running) < self.max_batch_seqs:
            request = self.waiting[0]
            tokens = request.num_tokens
            if admitted and tokens > budget:
                break
            # keep one page per running request for its next token, so admitting does not
            # immediately force a preemption
            if self.pool.pages_for(tokens) + len(self.running) > self.pool.available_pages():
                break
            self.waiting.popleft()
            self.pool.allocate(request.seq_id, tokens)
            request.status = RequestStatus.RUNNING
            request.num_computed = 0
            self.running.append(request)
            admitted.append(request)
            new_tokens.append(tokens)
            budget -= tokens
        if not admitted:
            return None
        return ScheduledBatch(admitted, new_tokens, True, [], ended)

    def _decode(self, ended: list[Request]) -> ScheduledBatch | None:
        scheduled: list[Request] = []
        copies: list[CopyOnWrite] = []
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            while not self.pool.can_append(request.seq_id, 1):
                if self.running == [request]:  # alone and still no room: the pool is too small
                    request.finish_reason = FinishReason.LENGTH
                    self.finish(request)
                    ended.append(request)
                    break
                victim = self.running[-1]
                self.preempt(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                copies.extend(self.pool.append(request.seq_id, 1))
                scheduled.append(request)
        if not scheduled:
            return None
        return ScheduledBatch(scheduled, [1] * len(scheduled), False, copies, ended)

    def preempt(self, request: Request) -> None:
        """Free a running request's pages and queue it first for recomputation."""
        self.running.remove(request)
        self.pool.free(request.seq_id)
        request.status = RequestStatus.WAITING
        request.num_computed = 0
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Drop a finished (or aborted) request and free its pages."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.pool.free(request.seq_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
