"""The pool map as a heat strip sized to the panel: used, cached and free pages, segments."""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.text import Text
from textual.widget import Widget

from kvctl.api import PoolMap
from kvctl.view import poolmap


class PoolMapView(Widget):
    """As many strips of the page map as fit the panel's height, each as wide as the panel."""

    DEFAULT_CSS = """
    PoolMapView { height: 1fr; min-height: 3; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.page_map: PoolMap | None = None

    def show(self, page_map: PoolMap | None) -> None:
        self.page_map = page_map
        self.refresh()

    def render(self) -> RenderableType:
        if self.page_map is None or self.page_map.capacity_pages == 0:
            return Text("no page map yet", style="dim")
        rows = max(1, (self.size.height - 1) // 2)
        return poolmap.grid(self.page_map, max(16, self.size.width), rows)
