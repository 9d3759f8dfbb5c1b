"""What an operator does to one pool's prefix cache: look a prompt up, pin and unpin a prefix,
list pins and the largest cached prefixes, and clear partitions from the device and the tiers.

Everything here runs on the engine thread, between two steps, and reads or changes the same
structures admission does (`Scheduler.prefix_matches`, `PrefixCache`, `TieredStore`), so what a
lookup reports is what the next request with that prompt and salt would reuse. Lookups and pins
name a partition by its cache salt; under `--prefix-isolation sampling` every set of sampling
settings has a partition of its own, which no salt names, so they are refused there.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvctl.agent.prefix import PrefixCache, PrefixMatch
from kvctl.agent.prefix.prefix_cache import PrefixIsolation
from kvctl.agent.runtime.prefix_pins import PrefixOpRefused, PrefixPin, PrefixPins
from kvctl.agent.runtime.scheduler import Scheduler
from kvctl.agent.tiers import TieredStore

DEFAULT_MAX_PINNED_SHARE = 0.25


@dataclass(frozen=True)
class PrefixLookup:
    """How much of a prompt a pool holds: whole-page prefixes on the device and in each tier,
    when the device's was last used, and the pins holding it."""

    salt: str | None
    prompt_tokens: int
    device_tokens: int
    device_pages: int
    tier_tokens: dict[str, int]
    last_used_at: float | None
    pins: list[str]


@dataclass(frozen=True)
class ClearReport:
    """What a clear let go: pages per place, pins removed, and pages of the cleared
    partitions that running requests still use (they leave with those requests)."""

    pages_freed: dict[str, int]
    pins_removed: list[PrefixPin]
    pages_in_use: int


class PrefixOperations:
    """Lookup, pins and clears for one pool (engine thread)."""

    def __init__(self, scheduler: Scheduler, cache: PrefixCache, tiers: TieredStore | None) -> None:
        self.scheduler = scheduler
        self.cache = cache
        self.tiers = tiers
        self.pins: PrefixPins = scheduler.pins
        self.max_pinned_share = DEFAULT_MAX_PINNED_SHARE

    @property
    def cap_pages(self) -> int:
        """The most pages pins may hold: the share of the pool's capacity."""
        return int(self.max_pinned_share * self.scheduler.pool.capacity)

    def lookup(self, salt: str | None, token_ids: Sequence[int]) -> PrefixLookup:
        """What the device and the tiers hold of `token_ids` in salt `salt`'s partition."""
        self._check_isolation()
        matches = self.scheduler.prefix_matches(salt, token_ids, len(token_ids))
        page_size = self.scheduler.pool.page_size
        tier_tokens: dict[str, int] = {}
        if self.tiers is not None:
            last = len(token_ids) // page_size
            keys = [m.key for m in matches]
            held = [self.tiers.prefix_pages(key, token_ids, last) for key in keys]
            tier_tokens = {name: min(h[name] for h in held) * page_size for name in held[0]}
        first = matches[0]
        pages = [p for m in matches for p in m.pages]
        return PrefixLookup(
            salt,
            len(token_ids),
            first.tokens,
            len(pages),
            tier_tokens,
            self.cache.last_used_at(first),
            self.pins.pins_of_page(pages),
        )

    def pin(self, salt: str | None, token_ids: Sequence[int], ttl_s: float | None) -> PrefixPin:
        """Pin the whole pages of `token_ids` the device holds; `PinRefused` when none are
        cached or the cap would be passed."""
        self._check_isolation()
        return self.pins.add(
            salt, token_ids, self._whole_pages(salt, token_ids), ttl_s, self.cap_pages
        )

    def store_below(self, salt: str | None, token_ids: Sequence[int], tier: str) -> int:
        """Copy the device's whole pages of `token_ids` into tier `tier` (the first below the
        device), keeping them on the device; how many tokens the tier then holds of it."""
        self._check_isolation()
        self.check_places({tier})
        tiers = self.tiers
        first = next((t.name for t in tiers.tiers if t.index.capacity), None) if tiers else None
        if tiers is None or tier != first:
            raise PrefixOpRefused(
                f"pages are stored into the first tier with room ({first or 'none'}) and reach "
                "the next one as it evicts them"
            )
        page_size = self.scheduler.pool.page_size
        matches = self._whole_pages(salt, token_ids)
        cut = matches[0].tokens
        if not cut:
            raise PrefixOpRefused("nothing of this prefix is cached on the device to store")
        for match in matches:
            tiers.store(match.key, token_ids[:cut], match.dropped, match.pages)
        held = [tiers.prefix_pages(m.key, token_ids, cut // page_size) for m in matches]
        return min(h[tier] for h in held) * page_size

    def _whole_pages(self, salt: str | None, token_ids: Sequence[int]) -> list[PrefixMatch]:
        """The device's whole pages of `token_ids` in salt `salt`'s partitions."""
        matches = self.scheduler.prefix_matches(salt, token_ids, len(token_ids))
        return self.scheduler.whole_pages(token_ids, matches)

    def unpin(self, pin_id: str) -> PrefixPin:
        return self.pins.remove(pin_id)

    def expire(self) -> list[PrefixPin]:
        return self.pins.expire() if len(self.pins) else []

    def clear(self, salts: Collection[str | None] | None, places: Collection[str]) -> ClearReport:
        """Forget the cached pages of the partitions of `salts` (every partition when None) in
        `places` ("device" and tier names), and, on the device, their pins first. Unknown tier
        names are refused before anything changes."""
        self.check_places(places)
        tier_names = self.places() - {"device"}
        removed: list[PrefixPin] = []
        freed: dict[str, int] = {}
        in_use = 0
        if "device" in places:
            for salt in [None] if salts is None else salts:
                removed += self.pins.remove_salt(salt, every=salts is None)
            keys = [k for k in self.cache.partitions() if salts is None or k.salt in salts]
            keys += [k for k in self.cache.window_partitions() if salts is None or k.salt in salts]
            freed["device"] = self.cache.drop(set(keys))
            in_use = self.cache.pages_of(set(keys))
        if self.tiers is not None:
            freed.update(self.tiers.drop(salts, set(places) & tier_names))
        return ClearReport(freed, removed, in_use)

    def places(self) -> set[str]:
        """Where this pool keeps cached pages: the device and its tiers."""
        return {"device", *(t.name for t in self.tiers.tiers)} if self.tiers else {"device"}

    def check_places(self, places: Collection[str]) -> None:
        """`PrefixOpRefused` naming a place this pool does not have."""
        unknown = set(places) - self.places()
        if unknown:
            have = ", ".join(sorted(self.places()))
            raise PrefixOpRefused(f"this pool has no {', '.join(sorted(unknown))} tier ({have})")

    def knows_salt(self, salt: str) -> bool:
        """Whether anything is cached or pinned under cache salt `salt`."""
        keys = [*self.cache.partitions(), *self.cache.window_partitions()]
        if any(k.salt == salt for k in keys) or any(p.salt == salt for p in self.pins.all()):
            return True
        return self.tiers is not None and self.tiers.knows_salt(salt)

    def _check_isolation(self) -> None:
        if self.cache.isolation is not PrefixIsolation.SALT:
            raise PrefixOpRefused(
                "prefix lookups and pins name a partition by its cache salt; this agent runs "
                "with --prefix-isolation sampling, where each set of sampling settings has its "
                "own partition"
            )
