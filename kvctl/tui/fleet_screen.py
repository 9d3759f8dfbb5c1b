"""The fleet at a glance: one row per agent and pool, like nvitop's process table.

Rows are rebuilt from the app's latest readings on every poll (a fleet is tens of agents, not
thousands), keeping the cursor on the row it was on. Sorting and the filter live here, so
they survive a trip into an agent's detail and back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Static

from kvctl.fleet import Reading
from kvctl.tui import fleet_rows
from kvctl.tui.fleet_rows import Sort
from kvctl.view import fmt
from kvctl.view.untrusted import clean

if TYPE_CHECKING:
    from kvctl.tui.app import TopApp


class FleetTable(DataTable[Text]):
    """The table, with Enter labelled for what it does here."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("enter", "select_cursor", "open")]


class FleetScreen(Screen[None]):
    """Every agent of the fleet (every pool of one that serves several models); Enter opens
    the highlighted one."""

    DEFAULT_CSS = """
    FleetScreen { layout: vertical; }
    FleetScreen #fleet-bar { height: 1; background: $boost; }
    FleetScreen DataTable { height: 1fr; scrollbar-size-vertical: 1; }
    FleetScreen #filter { height: 1; border: none; padding: 0 1; display: none; }
    FleetScreen #filter.open { display: block; }
    FleetScreen #fleet-status { height: 1; color: $text-muted; padding: 0 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("s", "sort_next", "sort"),
        Binding("S", "sort_reverse", "reverse"),
        Binding("slash", "filter", "filter", key_display="/"),
        Binding("escape", "clear_filter", "clear filter"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.sort = Sort()
        self.filter_text = ""
        self.readings: list[Reading] = []
        self.shown: list[Reading] = []
        """The rows, one per agent and pool, in the order shown."""
        self.total = fleet_rows.WIDE
        """The table's width at the last rebuild: which columns it shows."""

    @property
    def top(self) -> TopApp:
        return self.app  # type: ignore[return-value]  # Textual types it App[object]; only TopApp pushes this screen

    def compose(self) -> ComposeResult:
        yield Static(Text("connecting…", style="dim"), id="fleet-bar")
        yield FleetTable(cursor_type="row", cell_padding=0, id="fleet")
        yield Input(
            placeholder="filter: part of an agent URL, a pool or an alert name", id="filter"
        )
        yield Static("", id="fleet-status")
        yield Footer()

    def on_mount(self) -> None:
        self.show(self.readings)

    def on_resize(self) -> None:
        self.show(self.readings)

    def on_screen_resume(self) -> None:
        """Back from an agent's detail: the cursor on that agent and pool."""
        self.show(self.readings, highlight=self.top.shown_key())

    # ---- content --------------------------------------------------------------------------

    def show(self, readings: list[Reading], highlight: str | None = None) -> None:
        """Rebuild the table from `readings` (one per agent, in the order given), one row per
        agent and pool; `highlight` is the key of the row to put the cursor on."""
        self.readings = list(readings)
        tables = self.query(DataTable) if self.is_mounted else None
        if not tables:  # not composed yet, or being torn down: mount and resume show them
            return
        table = tables.first()
        if highlight is None and self.shown and 0 <= table.cursor_row < len(self.shown):
            highlight = fleet_rows.key_of(self.shown[table.cursor_row])
        rows = [row for reading in self.readings for row in reading.per_pool()]
        several = fleet_rows.pool_column(self.readings)
        total = max(20, table.size.width or self.size.width) - 1  # the scrollbar's column
        self.total = total
        shown = fleet_rows.columns(several, total)
        if self.sort.key is not None and self.sort.key not in [c.key for c in shown]:
            self.sort = Sort()  # its pool column went with the last agent that had several
        kept = [r for r in rows if fleet_rows.matches(r, self.filter_text)]
        self.shown = fleet_rows.sort_rows(kept, self.sort)
        names = [name for r in rows if several and (name := fleet_rows.pool_label(r))]
        widths = fleet_rows.widths(total, [r.agent for r in self.readings], names)
        table.clear(columns=True)
        for column in shown:
            label = fleet_rows.header(column, widths[column.key], self.sort)
            table.add_column(label, width=widths[column.key] + 1, key=column.key)
        keys = [fleet_rows.key_of(reading) for reading in self.shown]
        for reading, key in zip(self.shown, keys, strict=True):
            table.add_row(*fleet_rows.cells(reading, widths), key=key)
        if highlight in keys:
            table.move_cursor(row=keys.index(highlight), animate=False)
        self._bar()
        self._status()
        self.refresh_bindings()

    @property
    def rows_noun(self) -> str:
        return "pools" if fleet_rows.several_pools(self.readings) else "agents"

    def _bar(self) -> None:
        readings = self.readings
        if not readings:
            return
        down = sum(1 for r in readings if not r.up)
        firing = sum(len(r.firing) for r in readings)
        pools = sum(len(r.every_pool) for r in readings if r.up)
        fleet = f"fleet of {len(readings)} agents"
        if fleet_rows.several_pools(readings):
            fleet += f", {pools} pools"
        text = Text.assemble((f" {fleet} ", "reverse"), " ")
        text.append(f"{len(readings) - down} up", style=fmt.OK)
        if down:
            text.append(f"  {down} down", style=fmt.BAD)
        plural = "" if firing == 1 else "s"
        text.append(f"  {firing} alert{plural} firing", style=fmt.WARN if firing else "dim")
        if self.top.readonly:
            text.append("  read-only", style="reverse yellow")
        self.query_one("#fleet-bar", Static).update(text)

    def _status(self) -> None:
        status = self.sort.describe()
        if self.filter_text:
            rows = sum(len(r.per_pool()) for r in self.readings)
            status += (
                f" · filter “{clean(self.filter_text)}”: {len(self.shown)} of "
                f"{rows} {self.rows_noun} (esc clears)"
            )
        self.query_one("#fleet-status", Static).update(Text(status))

    # ---- keys and clicks ------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Escape is offered while there is a filter to clear."""
        if action == "clear_filter":
            return bool(self.filter_text) or self.query_one("#filter").has_class("open")
        return True

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        key = str(event.row_key.value)
        row = next((r for r in self.shown if fleet_rows.key_of(r) == key), None)
        if row is not None:
            pool = row.pool.pool if row.several and row.pool is not None else None
            self.top.open_agent(row.agent, pool)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        self.sort = self.sort.on(str(event.column_key.value))
        self.show(self.readings)

    def action_sort_next(self) -> None:
        self.sort = self.sort.next_column(
            fleet_rows.columns(fleet_rows.pool_column(self.readings), self.total)
        )
        self.show(self.readings)

    def action_sort_reverse(self) -> None:
        self.sort = self.sort.reversed()
        self.show(self.readings)

    def action_filter(self) -> None:
        field = self.query_one("#filter", Input)
        field.add_class("open")
        field.focus()
        self.refresh_bindings()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value
        self.show(self.readings)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter keeps the filter and goes back to the table."""
        event.stop()
        self._close_filter()

    def action_clear_filter(self) -> None:
        self.query_one("#filter", Input).value = ""
        self.filter_text = ""
        self._close_filter()
        self.show(self.readings)

    def _close_filter(self) -> None:
        self.query_one("#filter", Input).remove_class("open")
        self.query_one(DataTable).focus()
