"""Small, exact phrases the alert texts are built from: numbers, ages, sizes, settings, commands.

Every alert explains itself with the same vocabulary, so an on-call engineer reads "14 min ago",
"set `defrag.enabled=true`" and "`kvctl --agent http://node:8477 defrag --now`" the same way in
every alert. Nothing here knows about a particular alert.
"""

from __future__ import annotations

import json
import math

from kvctl.api import PoolSnapshot

GROW_FACTOR = 1.25
"""A resize suggestion for a pool that is too small adds a quarter."""
SHRINK_TARGET_UTILIZATION = 0.5
"""A resize suggestion for a pool that is too big leaves it half used, room for a burst."""
TRIM_TARGET_UTILIZATION = 0.9
"""A resize suggestion to free device memory gives back free pages but keeps a tenth spare."""


def ratio(value: float) -> str:
    """0.7137 → "0.71": fragmentation and other ratios that are not shares of a whole."""
    return f"{value:.2f}"


def percent(value: float) -> str:
    """0.975 → "97.5%", written like Prometheus' `humanizePercentage` so both sides agree."""
    return f"{value * 100:.4g}%"


def count(value: float) -> str:
    """212.0 → "212"."""
    return f"{value:.0f}"


def rate(value: float) -> str:
    """12.345 → "12.3"."""
    return f"{value:.1f}"


def span(seconds: float) -> str:
    """A span of time an engineer reads at a glance: "40 s", "14 min", "2.5 h"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def ago(seconds: float) -> str:
    """An age: "40 s ago", "14 min ago", "2.5 h ago"."""
    return f"{span(seconds)} ago"


def size(num_bytes: float) -> str:
    """Bytes in binary units with one decimal: 8589934592 → "8.0 GiB"."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.1f} {unit}" if unit != "B" else f"{value:.0f} B"
        value /= 1024
    return f"{value:.1f} TiB"


def size_arg(num_bytes: float) -> str:
    """Bytes as a `--size` argument, rounded down so it never asks for more than there is:
    the largest binary unit that keeps at least 10 of it, "37GiB", "5427MiB", "0"."""
    value = max(0, int(num_bytes))
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= 10 * scale:
            return f"{value // scale}{unit}"
    return str(value)


def size_arg_up(num_bytes: float) -> str:
    """Bytes as a size argument, rounded up so it asks for at least that much: the largest
    binary unit that keeps at least 10 of it, "14MiB", "41GiB"."""
    value = max(0, math.ceil(num_bytes))
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= 10 * scale:
            return f"{-(-value // scale)}{unit}"
    return str(value)


def seconds_per_token(seconds: float) -> str:
    """A time per token an engineer compares at a glance: "0.42 ms", "833 µs", "1.2 s"."""
    if seconds >= 1.0:
        return f"{seconds:.3g} s"
    if seconds >= 0.001:
        return f"{seconds * 1000:.3g} ms"
    return f"{seconds * 1_000_000:.3g} µs"


def sentence(phrase: str) -> str:
    """A phrase as the start of a sentence: its first letter upper case, the rest as it is."""
    return phrase[:1].upper() + phrase[1:]


def setting(key: str, value: object) -> str:
    """A runtime setting to change, named by its path in `GET/PATCH /v1/config`."""
    return f"`{key}={json.dumps(value)}`"


def patch(*settings: str) -> str:
    """One or more `setting(...)` phrases as one instruction."""
    return f"set {' and '.join(settings)} (PATCH /v1/config)"


def command(agent_url: str, args: str) -> str:
    """A kvctl command aimed at this agent, ready to paste."""
    return f"`kvctl --agent {agent_url} {args}`"


def pool_command(agent_url: str, snapshot: PoolSnapshot, args: str) -> str:
    """A kvctl command on the alert's own pool: with `--pool NAME` when the agent serves
    several models (their pools share a budget), where a command without it is refused."""
    return command(agent_url, f"{args} --pool {snapshot.pool}" if snapshot.share else args)


def round_up(pages: float, segment_pages: int) -> int:
    """Pages rounded up to whole segments, as the agent resizes."""
    segment = max(1, segment_pages)
    return max(segment, math.ceil(pages / segment) * segment)


def grow_target(snapshot: PoolSnapshot) -> int | None:
    """The pool size to try when it is too small, within `max_pool_pages`; None at the limit."""
    limit = snapshot.max_pool_pages
    if limit is not None and snapshot.capacity_pages >= limit:
        return None
    target = round_up(snapshot.capacity_pages * GROW_FACTOR, snapshot.segment_pages)
    return target if limit is None else min(target, limit)


def shrink_target(snapshot: PoolSnapshot, utilization: float = SHRINK_TARGET_UTILIZATION) -> int:
    """The pool size to try when it is too big: what is in use at `utilization`, never more
    than the pool has now."""
    in_use = snapshot.used_pages + snapshot.cached_pages
    return min(snapshot.capacity_pages, round_up(in_use / utilization, snapshot.segment_pages))


def trim_target(snapshot: PoolSnapshot) -> int:
    """The pool size that frees device memory: what is in use plus a tenth spare."""
    return shrink_target(snapshot, TRIM_TARGET_UTILIZATION)


def wanted_pages(snapshot: PoolSnapshot) -> int:
    """The pages a pool under pressure asks its budget for, as the rebalancer does: what its
    waiting requests are short of, at least one segment, in whole segments."""
    short = snapshot.share.short_pages if snapshot.share else 0
    return round_up(short, snapshot.segment_pages)


def raised_limit(snapshot: PoolSnapshot) -> int:
    """A `--max-pool-pages` value to try when the pool sits at its limit."""
    limit = snapshot.max_pool_pages or snapshot.capacity_pages
    return round_up(limit * GROW_FACTOR, snapshot.segment_pages)


def last_defrag(snapshot: PoolSnapshot) -> str:
    """What the last defragmentation did, in one phrase."""
    last, age = snapshot.last_defrag, snapshot.last_defrag_age_seconds
    if last is None or age is None:
        return "no defrag has run since the agent started"
    return f"last defrag {ago(age)} moved {last.pages_moved} pages"
