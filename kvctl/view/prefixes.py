"""Cached prefixes as operators read them: a lookup's answer per place, the pins and the largest
prefixes, and what a pin, an unpin or a clear did. Previews are the agent's text, shown through
`clean` and cut to one line."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvctl.view import fmt
from kvctl.view.untrusted import clean

if TYPE_CHECKING:
    from kvctl.api import (
        PrefixClearResult,
        PrefixListing,
        PrefixLookupResult,
        PrefixPinView,
    )

PREVIEW_CHARS = 48


def _preview(text: str) -> str:
    return clean(" ".join(text.split()), limit=PREVIEW_CHARS)


def _ago(at: float | None, now: float) -> str:
    return "–" if at is None else f"{fmt.seconds(max(0.0, now - at))} ago"


def _salt(salt: str | None) -> str:
    return "(none)" if salt is None else clean(salt)


def lookup_result(result: PrefixLookupResult) -> Table:
    """How much of the prompt each place holds, the device first."""
    table = Table(
        title=(
            f"{result.prompt_tokens} prompt tokens on model {clean(result.model)}, "
            f"cache salt {_salt(result.cache_salt)}"
        ),
        title_justify="left",
    )
    for column in ("place", "tokens cached", "pages", "last use", "pins"):
        table.add_column(column, justify="left" if column in ("place", "pins") else "right")
    now = time.time()
    pins = ", ".join(clean(p) for p in result.pins) or "–"
    table.add_row(
        "device",
        f"{result.device_tokens}",
        f"{result.device_pages}",
        _ago(result.last_used_at, now),
        pins,
    )
    for tier, tokens in result.tier_tokens.items():
        table.add_row(clean(tier), f"{tokens}", "–", "–", "–")
    return table


def pin_result(pin: PrefixPinView) -> Text:
    """What a pin holds and until when."""
    until = (
        "until unpinned"
        if pin.expires_at is None
        else f"for {fmt.seconds(max(0.0, pin.expires_at - time.time()))}"
    )
    return Text.assemble(
        (f"pinned {clean(pin.id)}", fmt.OK),
        f": {pin.tokens} tokens in {pin.pages} pages of model {clean(pin.model)}, cache salt "
        f"{_salt(pin.cache_salt)}, {until} — {_preview(pin.preview)!r}",
    )


def unpin_result(pin: PrefixPinView) -> Text:
    return Text.assemble(
        (f"unpinned {clean(pin.id)}", fmt.OK),
        f": its {pin.pages} pages stay cached and may be evicted again",
    )


def listing(result: PrefixListing) -> RenderableType:
    """The pins, then the largest cached prefixes."""
    now = time.time()
    share = result.pinned_pages / result.capacity_pages if result.capacity_pages else 0.0
    head = Text(
        f"pins hold {result.pinned_pages} of {result.capacity_pages} pages ({share:.0%}); "
        f"the cap is {result.pin_cap_pages}"
    )
    pins = Table(title="pins", title_justify="left")
    for column in ("id", "model", "salt", "tokens", "pages", "ends", "prefix"):
        pins.add_column(column, justify="right" if column in ("tokens", "pages") else "left")
    for pin in result.pins:
        ends = "never" if pin.expires_at is None else f"in {fmt.seconds(pin.expires_at - now)}"
        pins.add_row(
            clean(pin.id),
            clean(pin.model),
            _salt(pin.cache_salt),
            f"{pin.tokens}",
            f"{pin.pages}",
            ends,
            _preview(pin.preview),
        )
    largest = Table(title="largest cached prefixes", title_justify="left")
    for column in ("model", "salt", "tokens", "pages", "last use", "prefix"):
        largest.add_column(column, justify="right" if column in ("tokens", "pages") else "left")
    for prefix in result.prefixes:
        largest.add_row(
            clean(prefix.model),
            _salt(prefix.cache_salt),
            f"{prefix.tokens}",
            f"{prefix.pages}",
            _ago(prefix.last_used_at, now),
            _preview(prefix.preview),
        )
    parts: list[RenderableType] = [head]
    parts.append(pins if result.pins else Text("no pins", style="dim"))
    parts.append(largest if result.prefixes else Text("nothing cached", style="dim"))
    return Group(*parts)


def clear_result(result: PrefixClearResult) -> Text:
    """Pages freed per place, pins removed, and what running requests still hold."""
    freed = ", ".join(f"{n} {clean(place)}" for place, n in result.pages_freed.items()) or "none"
    text = Text.assemble(
        ("cleared", fmt.OK),
        f" {', '.join(clean(m) for m in result.models)}: pages freed {freed}; "
        f"{len(result.pins_removed)} pins removed",
    )
    if result.pages_in_use:
        text.append(
            f"; {result.pages_in_use} pages stay while running requests use them (they are "
            "cached again when those requests end: clear again then)"
        )
    return text
