"""Prefix pins: cached prefixes an operator keeps on the device through any eviction.

A pin holds its prefix's pages the way a running request does: it is a sequence of the pool
(one page table per page group, `RequestPages`) that adopted the cached pages, so their
reference count keeps eviction away, the defragmenter's moves rename them in its tables as in a
request's, and a shrink counts them as pages in use. Unpinning frees the sequence: the pages
stay in the prefix cache, cached and evictable again. Pins cover whole pages only (a pin never
writes), and never more than a cap of the pool's pages, so that pins cannot starve the requests
they are meant to speed up.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvctl.agent.prefix import PrefixMatch
from kvctl.agent.runtime.request_pages import RequestPages


class PrefixOpRefused(ValueError):
    """A prefix operation the pool cannot do as asked (one line, nothing changed)."""


class PinRefused(PrefixOpRefused):
    """A pin that would break the cap, or that has nothing cached to hold."""


class UnknownPin(LookupError):
    """No pin has this id."""


@dataclass(frozen=True)
class PrefixPin:
    """One pin: its prefix's first tokens (for showing), how many tokens and pages it holds,
    the cache salt whose partition they are in, and when it was made and ends (wall clock)."""

    pin_id: str
    salt: str | None
    token_ids: tuple[int, ...]
    tokens: int
    pages: int
    created_at: float
    expires_at: float | None


class PrefixPins:
    """The pins of one pool: made from a lookup's matches, freed by id, on expiry or a clear."""

    def __init__(self, pages: RequestPages, wall: Callable[[], float] = time.time) -> None:
        self.pages = pages
        self.wall = wall
        self._pins: dict[str, PrefixPin] = {}
        self.pinned_pages = 0  # distinct pages the pins hold

    def __len__(self) -> int:
        return len(self._pins)

    def all(self) -> list[PrefixPin]:
        return list(self._pins.values())

    def get(self, pin_id: str) -> PrefixPin:
        pin = self._pins.get(pin_id)
        if pin is None:
            raise UnknownPin(f"no pin {pin_id!r} (kvctl prefix ls lists them)")
        return pin

    def add(
        self,
        salt: str | None,
        token_ids: Sequence[int],
        matches: list[PrefixMatch],
        ttl_s: float | None,
        cap_pages: int,
    ) -> PrefixPin:
        """Pin the cached prefix `matches` found (whole pages, one match per page group);
        `PinRefused`, with nothing changed, when it is empty or the pins would pass `cap_pages`."""
        tokens = matches[0].tokens
        if not tokens:
            raise PinRefused(
                "nothing of this prefix is cached on the device in whole pages; send it once "
                "(or pin with --warm) and pin it then"
            )
        pool = self.pages.pool
        held = self._held()
        new = {p for match in matches for p in match.pages} - held
        after = len(held) + len(new)
        if after > cap_pages:
            share = cap_pages / pool.capacity if pool.capacity else 0.0
            raise PinRefused(
                f"pinning {len(new):,} more pages would pin {after:,} of the pool's "
                f"{pool.capacity:,} pages, above the cap of {cap_pages:,} ({share:.0%}, setting "
                "prefix_cache.max_pinned_share); unpin a prefix or raise the share"
            )
        pin_id = f"pin-{secrets.token_hex(4)}"  # unique across the agent's pools
        shared = [(m.pages, m.tokens, m.dropped) for m in matches]
        self.pages.adopt(_seq_id(pin_id), shared, tokens)
        now = self.wall()
        pin = PrefixPin(
            pin_id,
            salt,
            tuple(token_ids[:tokens]),
            tokens,
            sum(len(m.pages) for m in matches),
            now,
            None if ttl_s is None else now + ttl_s,
        )
        self._pins[pin_id] = pin
        self.pinned_pages = after
        return pin

    def remove(self, pin_id: str) -> PrefixPin:
        """Free a pin's pages (they stay cached); `UnknownPin` when there is none."""
        pin = self.get(pin_id)
        self.pages.free(_seq_id(pin_id))
        del self._pins[pin_id]
        self.pinned_pages = len(self._held())
        return pin

    def remove_salt(self, salt: str | None, every: bool = False) -> list[PrefixPin]:
        """Free the pins of one cache salt (of every salt when `every`)."""
        return [self.remove(p.pin_id) for p in self.all() if every or p.salt == salt]

    def expire(self) -> list[PrefixPin]:
        """Free the pins whose time has come."""
        now = self.wall()
        return [
            self.remove(p.pin_id)
            for p in self.all()
            if p.expires_at is not None and p.expires_at <= now
        ]

    def pins_of_page(self, pages: Sequence[int]) -> list[str]:
        """The pins holding any of `pages`."""
        wanted = set(pages)
        return [
            pin_id
            for pin_id in self._pins
            if any(wanted.intersection(t.pages) for t in self.pages.tables(_seq_id(pin_id)))
        ]

    def _held(self) -> set[int]:
        return {
            page
            for pin_id in self._pins
            for table in self.pages.tables(_seq_id(pin_id))
            for page in table.pages
        }


def _seq_id(pin_id: str) -> tuple[str, str]:
    """The pool sequence of a pin (requests' ids are strings: the two never collide)."""
    return ("pin", pin_id)
