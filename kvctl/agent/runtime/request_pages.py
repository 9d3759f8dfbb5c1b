"""A request's page tables in the pool: one per layer group (`layer_groups`).

For a model whose layers share every page there is one table, under the request's own sequence
id, and each operation here is the pool's. A model whose sliding and full layers keep separate
pages has a table per group, `(seq_id, group)`: each token takes a page slot in every group,
and the sliding groups give back the front pages their window has left (`release_window`).
Operations that take pages for several tables undo what they took when one of them cannot get
its pages, so a refused request leaves the pool as it was.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvctl.agent.pool import PagePool, PoolExhausted
from kvctl.agent.pool.page_pool import CopyOnWrite, PageTable
from kvctl.agent.runtime.layer_groups import LayerGroups, one_group


class RequestPages:
    """The page tables of requests, across the model's layer groups."""

    def __init__(self, pool: PagePool, groups: LayerGroups | None = None) -> None:
        self.pool = pool
        self.groups = groups or one_group(1)

    @property
    def count(self) -> int:
        """Page tables per request."""
        return self.groups.count

    def ids(self, seq_id: Hashable) -> tuple[Hashable, ...]:
        return self.groups.ids(seq_id)

    def pages_for(self, tokens: int) -> int:
        """Pages `tokens` tokens take when every group holds all of them (a prompt at
        admission, and the most a request may ever hold)."""
        return self.pool.pages_for(tokens) * self.groups.count

    def tables(self, seq_id: Hashable) -> list[PageTable]:
        table = self.pool.table
        return [table(i) for i in self.ids(seq_id)]

    def holds(self, seq_id: Hashable) -> bool:
        return self.ids(seq_id)[0] in self.pool

    def allocate(self, seq_id: Hashable, tokens: int) -> None:
        """Tables with room for `tokens` tokens in every group; PoolExhausted with nothing
        taken when they do not all fit."""
        self.adopt(seq_id, [((), 0, 0)] * self.count, tokens)

    def adopt(
        self, seq_id: Hashable, shared: Sequence[tuple[Sequence[int], int, int]], tokens: int
    ) -> list[CopyOnWrite]:
        """Tables starting on cached pages, `shared[g]` = (pages, tokens they hold, pages
        before them a window never reads) for group g, with room for `tokens`; the copies to
        apply first. PoolExhausted with nothing taken."""
        done: list[Hashable] = []
        copies: list[CopyOnWrite] = []
        try:
            for sub, (pages, held, dropped) in zip(self.ids(seq_id), shared, strict=True):
                if held:
                    copies += self.pool.adopt(sub, pages, held, tokens, dropped)[1]
                else:
                    self.pool.allocate(sub, tokens)
                done.append(sub)
        except PoolExhausted:
            for sub in done:
                self.pool.free(sub)
            raise
        return copies

    def grow_to(self, seq_id: Hashable, tokens: int) -> list[CopyOnWrite]:
        """Room for `tokens` tokens in every table; PoolExhausted when a table cannot grow (the
        tables before it keep their room: calling again goes on from there)."""
        copies: list[CopyOnWrite] = []
        for sub in self.ids(seq_id):
            table = self.pool.table(sub)
            if table.num_tokens < tokens:
                copies += self.pool.append(sub, tokens - table.num_tokens)
        return copies

    def tokens_held(self, seq_id: Hashable) -> int:
        """Tokens every table has room for (the last table grows last)."""
        return self.pool.table(self.ids(seq_id)[-1]).num_tokens

    def free(self, seq_id: Hashable) -> None:
        for sub in self.ids(seq_id):
            self.pool.free(sub)

    def release_window(self, seq_id: Hashable, computed: int) -> int:
        """Give back the front pages of the sliding groups that no query at `computed` or later
        reads; how many pages went back."""
        groups, pool = self.groups, self.pool
        released = 0
        for group in groups.sliding:
            sub = self.ids(seq_id)[group]
            table = pool.table(sub)
            count = min(
                groups.releasable(group, computed, pool.page_size) - table.dropped,
                len(table.pages) - 1,
            )
            if count > 0:
                pool.release_front(sub, count)
                released += count
        return released
