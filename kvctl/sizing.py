"""Resize targets as operators say them, turned into the request the agent takes.

`--pages 768`, `--size 8GiB`, `--grow 1GiB`, `--shrink 64` (and the TUI dialog's `768`, `8GiB`,
`+1GiB`, `-64`) all become one `ResizeRequest` plus the page counts to show in the confirmation.
A relative change is computed from the capacity the agent just reported, an amount without a
unit is pages and one with a unit is bytes, and the shown target is rounded up to whole segments
the way the agent rounds it, so the prompt says what will really happen.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TypedDict

from kvctl.api import PoolSnapshot, ResizeRequest
from kvctl.units import parse_size

_PAGES = re.compile(r"^\s*\d+\s*(pages?)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class ResizePlan:
    """What a resize will ask for and the sizes to show before asking."""

    request: ResizeRequest
    old_pages: int
    new_pages: int
    bytes_per_page: int
    asked_pages: int = 0  # before rounding to whole segments
    segment_pages: int = 1

    @property
    def rounded(self) -> bool:
        return self.asked_pages != self.new_pages

    @property
    def old_bytes(self) -> int:
        return self.old_pages * self.bytes_per_page

    @property
    def new_bytes(self) -> int:
        return self.new_pages * self.bytes_per_page

    @property
    def direction(self) -> str:
        if self.new_pages == self.old_pages:
            return "none"
        return "grow" if self.new_pages > self.old_pages else "shrink"


class ResizeSpec(TypedDict):
    """The four ways to name a size, as `kvctl pool resize` takes them (exactly one is set)."""

    pages: int | None
    size: str | None
    grow: str | None
    shrink: str | None


def amount_in_pages(text: str, bytes_per_page: int) -> int:
    """Pages in "64" or "64 pages" (a count), or in "1GiB" (bytes, rounded up to pages)."""
    if _PAGES.match(text):
        return int(re.sub(r"\D", "", text))
    return math.ceil(parse_size(text) / bytes_per_page)


def _whole_segments(pages: int, pool: PoolSnapshot) -> int:
    return max(1, math.ceil(pages / pool.segment_pages)) * pool.segment_pages


def plan_resize(
    pool: PoolSnapshot,
    *,
    pages: int | None = None,
    size: str | None = None,
    grow: str | None = None,
    shrink: str | None = None,
) -> ResizePlan:
    """The request for exactly one of the four ways to name a size; ValueError says what's off."""
    if sum(value is not None for value in (pages, size, grow, shrink)) != 1:
        raise ValueError("give exactly one of --pages, --size, --grow or --shrink")
    if pages is not None:
        if pages < 1:
            raise ValueError(f"--pages {pages} is not a pool size; give at least 1 page")
        return _plan(pool, ResizeRequest(pages=pages), pages)
    if size is not None:
        count = parse_size(size)
        if count < 1:
            raise ValueError(f"--size {size} is empty; give a size such as 8GiB")
        return _plan(pool, ResizeRequest(bytes=count), math.ceil(count / pool.bytes_per_page))
    if grow is not None:
        target = pool.capacity_pages + amount_in_pages(grow, pool.bytes_per_page)
        return _plan(pool, ResizeRequest(pages=target), target)
    assert shrink is not None
    target = pool.capacity_pages - amount_in_pages(shrink, pool.bytes_per_page)
    if target < 1:
        raise ValueError(
            f"cannot shrink by {shrink}: the pool has only {pool.capacity_pages} pages; "
            "give a smaller amount or use --pages"
        )
    return _plan(pool, ResizeRequest(pages=target), target)


def _plan(pool: PoolSnapshot, request: ResizeRequest, target_pages: int) -> ResizePlan:
    return ResizePlan(
        request=request,
        old_pages=pool.capacity_pages,
        new_pages=_whole_segments(target_pages, pool),
        bytes_per_page=pool.bytes_per_page,
        asked_pages=target_pages,
        segment_pages=pool.segment_pages,
    )


def plan_from_text(pool: PoolSnapshot, text: str) -> ResizePlan:
    """The TUI dialog's input: "768" pages, "8GiB" a size, "+X" grow by X, "-X" shrink by X."""
    value = text.strip()
    if not value:
        raise ValueError("type a new size: 768 (pages), 8GiB, +1GiB or -64")
    if value[0] == "+":
        return plan_resize(pool, grow=value[1:])
    if value[0] == "-":
        return plan_resize(pool, shrink=value[1:])
    if _PAGES.match(value):
        return plan_resize(pool, pages=amount_in_pages(value, pool.bytes_per_page))
    return plan_resize(pool, size=value)


# ---- what a pool holds ----------------------------------------------------------------------


@dataclass(frozen=True)
class PoolFit:
    """What a pool of `pages` holds for a model of `context` tokens (None: not known).

    One computation for the agent's start-up log and `kvctl pool show`, so both say the same.
    A request needs pages for its prompt plus `max_tokens` at once (the agent refuses one that
    could never fit), so the largest request is the smaller of the pool and the context.
    `groups`: page tables per request (a model whose sliding-window layers keep pages of their
    own has one per layer group, each page holding that group's layers), so a block of tokens
    takes that many pages at admission.
    """

    page_size: int
    bytes_per_page: int
    pages: int
    context: int | None = None
    groups: int = 1

    @property
    def tokens(self) -> int:
        return self.pages // self.groups * self.page_size

    @property
    def largest_request(self) -> int:
        """The most tokens (prompt + max_tokens) one request may have."""
        return self.tokens if self.context is None else min(self.tokens, self.context)

    @property
    def short_of_context(self) -> bool:
        """The pool holds fewer tokens than the model's context."""
        return self.context is not None and self.tokens < self.context

    def pages_for(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.page_size)) * self.groups

    def concurrent(self, tokens: int) -> int:
        """Requests of `tokens` each that fit at once."""
        return self.pages // self.pages_for(tokens)

    def pages_for_contexts(self, requests: int) -> int:
        """Pages that hold the model's full context for `requests` at once (needs `context`)."""
        assert self.context is not None
        return requests * self.pages_for(self.context)
