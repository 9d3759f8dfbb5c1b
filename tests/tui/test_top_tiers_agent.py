"""`kvctl top` against a real agent with a host tier: the tier panel appears beside the page map
and shows where reused prompt tokens came from and the prefill saved while traffic runs."""

from __future__ import annotations

import asyncio
import re

import pytest

from kvctl.api import CompletionRequest
from kvctl.client import AgentClient
from kvctl.tui.app import TopApp
from kvctl.tui.source import HttpSource
from kvctl.tui.widgets.tiers import TierPanel

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


def text(i: int) -> str:
    return " ".join(f"w{i}x{j}" for j in range(60))


def send(url: str) -> None:
    """Five prompts: the first is evicted to the host tier by the next three, then sent again."""
    with AgentClient(url, timeout=60) as client:
        for i in (0, 1, 2, 3, 0):
            client.complete(CompletionRequest(prompt=text(i), max_tokens=1))


async def test_the_tier_panel_follows_a_live_agent(start_agent, fakes) -> None:
    running = start_agent(
        "--pool-pages", "64", "--segment-pages", "8", "--page-size", "16",
        "--host-tier-memory", "16MiB",
    )  # fmt: skip
    app = TopApp(HttpSource([running.url], timeout=10), interval=0.3)
    async with app.run_test(size=(160, 45)) as pilot:
        await fakes.wait_until(pilot, lambda: running.url in app.last_good)
        panel = app.query_one(TierPanel)
        assert app.detail.tiers_panel.display  # the agent has a tier, empty so far
        await asyncio.to_thread(send, running.url)

        def shown() -> str:
            return fakes.widget_text(panel, 76)

        def host_share() -> float:
            found = re.search(r"   host (\d+\.\d) %", shown())
            return float(found.group(1)) if found else 0.0

        await fakes.wait_until(pilot, lambda: host_share() > 0)
        lines = shown()
        assert "reused  device " in lines and " tok/s of prefill " in lines
        assert "host  lru " in lines and "prefill " in lines
