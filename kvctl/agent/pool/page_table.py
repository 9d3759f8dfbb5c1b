"""What one sequence holds: its page table, the copy storage must make, and runs of page ids.

Kept apart from the pool so the parts of the pool (reservations, loose pages, cache holds,
relocation, the invariant check) can name a table without importing the pool itself.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

SeqId = Hashable


class PageTable:
    """The pages of one sequence, in token order, and how many tokens they hold.

    The flags let the hot paths skip checks; each is conservative (False is always safe):
    `writable`: the last page, if any, is held by this table alone and not by the prefix cache,
    so tokens can be written into it without a copy. `private`: every page is held by this table
    alone and none by the prefix cache, so `free` can return the pages run by run, where
    `run_starts` holds the index in `pages` of each run's first page. `reserve_next` and
    `reserve_end` bound the pages reserved for this sequence's growth, which follow its last page.
    Pages from `loose_from` on came one at a time from the loose pages and go back there.
    `dropped` counts the front pages given back while the sequence runs (those a sliding window
    has left): `pages[i]` holds the tokens of page `dropped + i`.
    (A plain slotted class: one is built per request, on the allocation fast path.)
    """

    __slots__ = (
        "dropped",
        "loose_from",
        "num_tokens",
        "pages",
        "private",
        "reserve_end",
        "reserve_next",
        "room",
        "run_starts",
        "seq_id",
        "writable",
    )

    def __init__(
        self,
        seq_id: SeqId,
        pages: list[int],
        num_tokens: int,
        room: int,
        shared: bool = False,
        run_starts: Sequence[int] = (0,),
    ) -> None:
        self.seq_id = seq_id
        self.pages = pages
        self.num_tokens = num_tokens
        self.room = room  # tokens the pages can hold: (dropped + len(pages)) * page_size
        self.writable = self.private = not shared
        self.run_starts = run_starts  # a tuple until a second run begins
        self.reserve_next = self.reserve_end = 0
        self.loose_from = -1  # pages from this index on were taken one by one (-1: none)
        self.dropped = 0

    def positional(self) -> list[int]:
        """The pages by token position: a dropped page's place repeats the first page held
        (readers skip the positions a window has left, but a page table has no holes)."""
        if not self.dropped:
            return self.pages
        return self.pages[:1] * self.dropped + self.pages

    def __repr__(self) -> str:
        return f"PageTable({self.seq_id!r}, pages={self.pages}, num_tokens={self.num_tokens})"

    @property
    def is_run(self) -> bool:
        """The pages are one ascending run of consecutive ids that no one else holds."""
        return self.private and self.loose_from < 0 and len(self.run_starts) <= 1

    @property
    def reserved(self) -> int:
        return self.reserve_end - self.reserve_next


@dataclass(frozen=True)
class CopyOnWrite:
    """Storage must copy page `src` to `dst` before the sequence writes into `dst`."""

    src: int
    dst: int


def runs_of(pages: Sequence[int]) -> Iterator[tuple[int, int]]:
    """Split page ids into maximal ascending runs of consecutive ids, as (start, length)."""
    start = -1
    length = 0
    for p in pages:
        if p == start + length:
            length += 1
        else:
            if length:
                yield start, length
            start, length = p, 1
    if length:
        yield start, length


def run_starts_of(pages: Sequence[int]) -> list[int]:
    """Indexes in `pages` where a maximal ascending run of consecutive ids begins."""
    starts = [0]
    for i in range(1, len(pages)):
        if pages[i] != pages[i - 1] + 1:
            starts.append(i)
    return starts


def as_run(pages: Sequence[int], ids: list[int]) -> int | None:
    """The first id if `pages` are one ascending run of at least 4 consecutive ids, else None.

    Cheap: `ids` are the pool's page ids, whose int objects table pages share, so the list
    comparison is by identity. Used by the pool and by its cache holds alike, to treat a run
    with a few slice operations instead of page by page.
    """
    n = len(pages)
    if n < 4:
        return None
    lo = pages[0]
    if not 0 <= lo <= len(ids) - n or pages[-1] != lo + n - 1:
        return None
    return lo if pages == ids[lo : lo + n] else None
