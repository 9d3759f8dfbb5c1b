"""The fleet table's rows: which columns, how each is sorted, filtered and fitted to a width.

Pure functions of `kvctl.fleet.Reading`, so sorting and filtering are tested without a
terminal. A row is one agent and pool (`Reading.per_pool`): an agent with one pool is one row
keyed by its URL, as before several models; where some agent serves several, a pool column
appears and those rows are keyed by URL and pool.

Sorting puts the worst rows first on the first press (lowest allocation success, highest
fragmentation, …): that is what an operator sorts a fleet for. Rows that have no value in the
sorted column (down agents, nothing measured yet) go last in either direction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich.text import Text

from kvctl.engines import BY_NAME, KVCTL
from kvctl.fleet import Reading
from kvctl.tui.widgets.alerts import ORDER
from kvctl.view import fmt
from kvctl.view.untrusted import PROSE_LIMIT, clean

SortValue = float | str | None


@dataclass(frozen=True)
class Column:
    """A fleet column: its label, content width (None: shares what is left), alignment, what
    it sorts by, and whether high values are the worst."""

    key: str
    label: str
    width: int | None
    value: Callable[[Reading], SortValue]
    right: bool = True
    worst_high: bool = True


def _figure(attribute: str) -> Callable[[Reading], SortValue]:
    """A figure of the row, None where its node did not answer or does not export it."""

    def value(reading: Reading) -> SortValue:
        figures = reading.row_figures if reading.up else None
        return None if figures is None else getattr(figures, attribute)

    return value


def _pool_name(reading: Reading) -> SortValue:
    return reading.row_name


def _alerts(reading: Reading) -> SortValue:
    if not reading.up:
        return None
    firing = reading.firing
    critical = sum(1 for alert in firing if alert.severity == "critical")
    return critical * 1000 + len(firing) * 10 + min(9, len(reading.alerts) - len(firing))


COLUMNS: tuple[Column, ...] = (
    Column("agent", "agent", None, lambda r: r.agent, right=False, worst_high=False),
    Column("state", "state", 5, lambda r: 0.0 if r.up else 1.0, right=False),
    Column("alloc", "alloc ok", 8, _figure("alloc_success_ratio"), worst_high=False),
    Column("frag", "frag", 4, _figure("fragmentation_ratio")),
    Column("util", "util", 7, _figure("utilization_ratio")),
    Column("prefix", "prefix", 7, _figure("prefix_hit_ratio"), worst_high=False),
    Column("preempt", "preempt", 7, _figure("preemptions")),
    Column("run", "run", 3, _figure("requests_running")),
    Column("wait", "wait", 4, _figure("requests_waiting")),
    Column("alerts", "firing alerts", None, _alerts, right=False),
)
POOL = Column("pool", "pool", None, _pool_name, right=False, worst_high=False)
"""Shown after the agent where some agent serves several models."""
BY_KEY = {column.key: column for column in (*COLUMNS, POOL)}


WIDE = 100
"""Table width from which the preemptions column is shown (at 80 the agent names keep it)."""


def columns(pools: bool, total: int = WIDE) -> tuple[Column, ...]:
    """The columns of a fleet `total` cells wide, with the pool's after the agent's where
    `pools`, and preemptions where there is room."""
    shown = COLUMNS if total >= WIDE else tuple(c for c in COLUMNS if c.key != "preempt")
    return (shown[0], POOL, *shown[1:]) if pools else shown


def several_pools(readings: Sequence[Reading]) -> bool:
    """Whether some agent serves several models."""
    return any(reading.several for reading in readings)


def pool_column(readings: Sequence[Reading]) -> bool:
    """Whether rows need the pool column: some agent serves several models, or some node is an
    engine (the column names it)."""
    return any(reading.several or reading.engine != KVCTL for reading in readings)


def pool_label(reading: Reading) -> str | None:
    """The pool column of a row: the pool's name, or an engine's name and its model's (as
    `untrusted.clean` shows them)."""
    if reading.engine == KVCTL:
        return None if reading.row_name is None else clean(reading.row_name)
    return f"{BY_NAME[reading.engine].title} {clean(reading.row_name or '')}".rstrip()


def row_key(agent: str, pool: str | None) -> str:
    """The key of a row: the agent's URL, and the pool's name where the agent has several."""
    return agent if pool is None else f"{agent}#{pool}"


def key_of(reading: Reading) -> str:
    """The key of a row (one of `Reading.per_pool()`)."""
    return row_key(reading.agent, reading.row_name if reading.several else None)


@dataclass(frozen=True)
class Sort:
    """The sorted column (None: the order the agents were given) and its direction."""

    key: str | None = None
    descending: bool = False

    def next_column(self, shown: Sequence[Column] = COLUMNS) -> Sort:
        """The next of the `shown` columns, worst first; after the last, back to the order
        given."""
        keys = [None, *(column.key for column in shown)]
        if self.key not in keys:
            return Sort()
        key = keys[(keys.index(self.key) + 1) % len(keys)]
        return Sort(key, key is not None and BY_KEY[key].worst_high)

    def on(self, key: str) -> Sort:
        """Sort by `key`, worst first; the column already sorted by is reversed."""
        if key == self.key:
            return self.reversed()
        return Sort(key, BY_KEY[key].worst_high)

    def reversed(self) -> Sort:
        return Sort(self.key, not self.descending)

    def describe(self) -> str:
        if self.key is None:
            return "in the order given" + (", reversed" if self.descending else "")
        column = BY_KEY[self.key]
        worst = self.descending == column.worst_high
        order = "worst first" if worst else "best first"
        if self.key in ("agent", "pool"):
            order = "Z to A" if self.descending else "A to Z"
        return f"sorted by {column.label}, {order}"


def sort_rows(readings: Sequence[Reading], sort: Sort) -> list[Reading]:
    """`readings` in `sort`'s order; ties keep the order given, rows without a value last."""
    if sort.key is None:
        return list(reversed(readings)) if sort.descending else list(readings)
    value = BY_KEY[sort.key].value
    present = [r for r in readings if value(r) is not None]
    missing = [r for r in readings if value(r) is None]
    present.sort(key=value, reverse=sort.descending)  # type: ignore[arg-type]  # None filtered out above
    return present + missing


def matches(reading: Reading, text: str) -> bool:
    """Whether the filter `text` is in the agent's URL, its engine ("vllm"), the name of one
    of its alerts, or the name of the row's pool where the agent has several."""
    needle = text.strip().lower()
    if not needle:
        return True
    pool = [reading.row_name] if reading.several and reading.row_name else []
    names = [reading.agent, reading.engine, *pool, *(alert.name for alert in reading.alerts)]
    return any(needle in name.lower() for name in names)


def short_agent(url: str) -> str:
    """The URL as a row shows it (`untrusted.clean`): `http://` is the default and says
    nothing."""
    return clean(url.removeprefix("http://"))


def ellipsize(text: str, width: int) -> str:
    """`text` cut to `width` cells with an ellipsis, never wrapped."""
    if width <= 0:
        return ""
    return text if len(text) <= width else text[: width - 1] + "…"


def widths(total: int, agents: Sequence[str], pools: Sequence[str] = ()) -> dict[str, int]:
    """Content width of every column for a table `total` cells wide (one cell between
    columns): fixed columns as they are, the agent column as wide as its longest name but at
    most 40 % of the rest, the alerts column what remains. With `pools` (the names of the
    pools of agents that serve several models), a pool column as wide as the longest name,
    within 4 to 16 cells."""
    shown = columns(bool(pools), total)
    fixed = {c.key: c.width for c in shown if c.width is not None}
    if pools:
        fixed["pool"] = max(4, min(16, max(len(name) for name in pools)))
    rest = max(0, total - sum(fixed.values()) - len(shown))
    longest = max((len(short_agent(agent)) for agent in agents), default=5)
    agent = max(5, min(longest, rest * 2 // 5))
    return {**fixed, "agent": agent, "alerts": max(5, rest - agent)}


def alerts_text(reading: Reading, width: int) -> Text:
    """Firing alert names, worst first, whole where they fit, then `+N`; the error of a down
    agent; `N pending` or `none` when nothing fires."""
    if not reading.up:
        reason = clean(reading.error.reason, PROSE_LIMIT) if reading.error else "no answer"
        return Text(ellipsize(reason, width), style=fmt.BAD)
    firing = sorted(reading.firing, key=lambda a: (ORDER[a.severity], a.name))
    if not firing:
        pending = len(reading.alerts)
        label, style = (f"{pending} pending", "dim") if pending else ("none", fmt.OK)
        return Text(ellipsize(label, width), style=style)
    text = Text()
    for index, alert in enumerate(firing):
        name = clean(alert.name)
        more = len(firing) - index - 1
        tail = f" +{more}" if more else ""
        sep = ", " if index else ""
        if len(text) + len(sep) + len(name) + len(tail) > width:
            if index == 0:
                text.append(ellipsize(name, width - len(tail)), fmt.severity_style(alert.severity))
                text.append(tail)
            else:
                text.append(f" +{len(firing) - index}")
            break
        text.append(sep)
        text.append(name, style=fmt.severity_style(alert.severity))
    return text


def cells(reading: Reading, fitted: dict[str, int]) -> list[Text]:
    """The row of one agent and pool, each cell exactly its column's width (`fitted`, from
    `widths`; a pool column where it has one)."""
    texts: dict[str, Text] = {
        "agent": Text(ellipsize(short_agent(reading.agent), fitted["agent"]), style="bold"),
        "alerts": alerts_text(reading, fitted["alerts"]),
        "state": Text("up", style=fmt.OK) if reading.up else Text("down", style=fmt.BAD),
    }
    name = pool_label(reading)
    if "pool" in fitted and name is not None:
        texts["pool"] = Text(ellipsize(name, fitted["pool"]))
    figures = reading.row_figures
    if reading.up and figures is not None:
        numbers = zip(
            ("alloc", "frag", "util", "prefix"), fmt.figure_headlines(figures), strict=True
        )
        for key, headline in numbers:
            texts[key] = Text(headline.text, style=headline.style)
        texts["preempt"] = Text(fmt.count(figures.preemptions))
        texts["run"] = Text(fmt.count(figures.requests_running))
        waiting = figures.requests_waiting
        texts["wait"] = Text(fmt.count(waiting), style=fmt.WARN if waiting else "")
        if not reading.alerts_read:
            texts["alerts"] = Text(
                ellipsize(f"{reading.engine}: none read", fitted["alerts"]), "dim"
            )
    shown = columns("pool" in fitted, WIDE if "preempt" in fitted else 0)
    return [_fit(texts.get(c.key, Text("–", style="dim")), c, fitted[c.key]) for c in shown]


def header(column: Column, width: int, sort: Sort) -> Text:
    """The column's label, with ▼ or ▲ next to it when the table is sorted by it (in the cell
    between columns where the label fills its own)."""
    label, lead = column.label, " "
    if sort.key == column.key:
        arrow = "▼" if sort.descending else "▲"
        if len(label) < width:
            label = f"{arrow}{label}" if column.right else f"{label}{arrow}"
        else:
            lead = arrow
    return _fit(Text(label, style="bold"), column, width, lead)


def _fit(text: Text, column: Column, width: int, lead: str = " ") -> Text:
    """Cut to `width`, pad to it, and lead with the one cell that separates columns."""
    text = text.copy()
    text.truncate(width, overflow="ellipsis")
    if column.right:
        text.pad_left(width - len(text))
    else:
        text.pad_right(width - len(text))
    return Text(lead) + text
