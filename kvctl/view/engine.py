"""A node that is not a kvctl agent read directly, as rows and a detail: what its engine
exports, "–" for what it does not, and the pitfalls of the figures it does."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvctl.engines import BY_NAME, KVCTL
from kvctl.units import format_bytes
from kvctl.view import fmt
from kvctl.view.untrusted import PROSE_LIMIT, clean, safe

if TYPE_CHECKING:
    from kvctl.figures import Figures
    from kvctl.fleet import Reading

SOURCES = {"agent": "its API", "metrics": "its /metrics", "prometheus": "Prometheus"}


def title_of(engine: str) -> str:
    return "kvctl" if engine == KVCTL else BY_NAME[engine].title


def row_label(reading: Reading) -> Text:
    """The pool column: the pool and its device for an agent, else the engine and its model
    (first, so a long model name cut to the column keeps the engine)."""
    if reading.pool is not None and reading.source == "agent":
        return Text(f"{clean(reading.pool.pool)} ({clean(reading.pool.device)})")
    if reading.engine == KVCTL:
        return Text(f"{clean(reading.row_name or '–')} (kvctl)")
    model = clean(reading.row_name or "")
    return Text(f"{title_of(reading.engine)} {model}".rstrip())  # cut: the model


def capacity_text(reading: Reading) -> str:
    """An agent's pool in bytes, however it was read; an engine's KV in tokens, as it reports
    it; "–" without."""
    figures = reading.row_figures
    if figures is not None and figures.capacity_bytes is not None:
        return format_bytes(figures.capacity_bytes)
    return tokens(None if figures is None else figures.capacity_tokens)


def tokens(count: int | None) -> str:
    """A token count short enough for a cell: "9,216 tok", "1.2M tok"."""
    if count is None:
        return "–"
    if count < 100_000:
        return f"{count:,} tok"
    if count < 100_000_000:
        return f"{count / 1000:,.0f}k tok"
    return f"{count / 1e6:,.0f}M tok"


def detail(reading: Reading) -> RenderableType:
    """One node read from its /metrics (or from Prometheus): every figure with where it
    comes from, every model's row when it serves several, and its engine's pitfalls."""
    title = Text.assemble(("● up  ", fmt.OK), (clean(reading.agent), "bold"))
    title.append(f"  {title_of(reading.engine)}, read from {SOURCES[reading.source]}", "dim")
    rows = reading.per_pool()
    parts: list[RenderableType] = [title]
    for row in rows:
        if row.row_figures is not None:
            name = row.row_name if len(rows) > 1 else None
            parts.append(figures_table(row.row_figures, name, reading.engine))
    if reading.notes:
        notes = Table.grid(padding=(0, 1))
        notes.add_column(style="yellow", no_wrap=True)
        notes.add_column()
        for note in reading.notes:
            notes.add_row("!", safe(note, limit=PROSE_LIMIT))
        parts.append(notes)
    return Group(*parts)


def exported(engine: str, figure: str) -> bool:
    """Whether `engine` exports `figure` at all (kvctl exports every one)."""
    return engine == KVCTL or BY_NAME[engine].exports(figure)


def figures_table(figures: Figures, model: str | None = None, engine: str = KVCTL) -> Table:
    """The figures as label/value pairs; "–" says whether the engine does not export it or
    nothing was measured, never a guess."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    if model is not None:
        table.title = Text(f"model {clean(model)}")
        table.title_justify, table.title_style = "left", "bold"
    for headline in fmt.figure_headlines(figures):
        text = Text(headline.text, style=headline.style)
        if headline.ratio is None and headline.text == "–":
            why = "nothing measured" if exported(engine, headline.label) else "not exported"
            text.append(f"  {why}", style=fmt.DIM)
        elif headline.label == "prefix hits" and figures.prefix_span:
            text.append(f"  {figures.prefix_span}", style=fmt.DIM)
        table.add_row(headline.label, text)
    preempted = Text(fmt.count(figures.preemptions))
    if not exported(engine, "preemptions"):
        preempted.append("  not exported", style=fmt.DIM)
    elif figures.preemptions_span:
        preempted.append(f"  {figures.preemptions_span}", style=fmt.DIM)
    table.add_row("preemptions", preempted)
    running, waiting = fmt.count(figures.requests_running), fmt.count(figures.requests_waiting)
    table.add_row("requests", f"{running} running, {waiting} waiting")
    capacity = tokens(figures.capacity_tokens)
    if figures.capacity_bytes is not None:
        capacity += f", {format_bytes(figures.capacity_bytes)}"
    if figures.blocks is not None and figures.block_tokens is not None:
        capacity += f" ({figures.blocks:,} blocks of {figures.block_tokens} tokens)"
    table.add_row("KV capacity", capacity)
    return table
