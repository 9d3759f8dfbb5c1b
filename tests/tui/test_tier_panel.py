"""The tier panel of `kvctl top`: shown only for an agent with tiers, beside the page map, with
the split of reused tokens, the prefill saved per second and each tier's fill and load rate;
text snapshots at 80×24 and 160×45 (KVCTL_UPDATE_SNAPSHOTS=1 rewrites them)."""

from __future__ import annotations

from typing import Any

import pytest
from pool_readings import tier_reading

from kvctl.api import TierReading
from kvctl.tui.detail import DetailScreen
from kvctl.tui.history import RateWindow
from kvctl.tui.widgets.tiers import TierPanel, tier_lines

pytestmark = pytest.mark.anyio

A = "http://node1:8477"
NOW = 1_800_000_000.0
PAGE = 64 << 10
STEP = 5.0
POLLS = 13
SIZES = [(80, 24), (160, 45)]


def tier(
    name: str, capacity: int, used: int, hits: int, seconds_per_token: float, **more
) -> TierReading:
    """A tier that loaded `hits` tokens (pages of 16) at `seconds_per_token`."""
    pages = hits // 16
    fields: dict[str, Any] = dict(
        capacity_pages=capacity, used_pages=used, hits_tokens_total=hits,
        stored_pages_total=used + 100, stored_bytes_total=(used + 100) * PAGE,
        loaded_pages_total=pages, loaded_bytes_total=pages * PAGE,
        store_seconds_total=0.5, load_seconds_total=hits * seconds_per_token,
    )  # fmt: skip
    return tier_reading(name, **{**fields, **more})


def tiered(fakes, i: int, **numbers: Any):
    """Poll `i` of a busy agent with a host and a disk tier, 5 s after poll `i - 1`: every
    second 30 tokens reused on the device, 80 from host and 8 from disk."""
    device, host, disk = 3_000 + 150 * i, 1_024 + 400 * i, 208 + 40 * i
    tiers = [
        tier("host", 131_072, 40_000 + 800 * i, host, 4e-6),
        tier(
            "disk", 1_600_000, 220_000 + 20 * i, disk, 4e-5, path="/var/cache/kvctl",
            filesystem_free_bytes=800 << 30, filesystem_size_bytes=2 << 40,
            load_failures_total={"missing": 0, "truncated": 0, "checksum": 2, "io": 0},
        ),
    ]  # fmt: skip
    fields = dict(
        timestamp=NOW + STEP * i,
        prefix_hits_tokens_total=device + host + disk,
        prefix_queries_tokens_total=8_000 + 800 * i,
        prefix_hits_tokens_by_tier={"device": device, "host": host, "disk": disk},
        tiers=tiers,
        prefill_seconds_per_token=1.06e-4,
    )
    return fakes.reading(
        A, alerts=[fakes.alert("KvctlFragmentationHigh", "critical")], **{**fields, **numbers}
    )


async def screen(fakes, readings, size: tuple[int, int]) -> str:
    app = fakes.make_app({A: readings}, step=STEP)
    async with app.run_test(size=size) as pilot:
        await fakes.polled(app, pilot, len(readings))
        assert isinstance(app.screen, DetailScreen)
        return fakes.screen_text(app)


@pytest.mark.parametrize("size", SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
async def test_snapshot(fakes, size: tuple[int, int]) -> None:
    text = await screen(fakes, [tiered(fakes, i) for i in range(POLLS)], size)
    assert len(text.splitlines()) == size[1]
    fakes.check_snapshot(f"tiers_{size[0]}x{size[1]}", text)


@pytest.mark.parametrize("size", SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
async def test_the_panel_and_the_map_share_the_bottom_and_nothing_is_cut(fakes, size) -> None:
    text = await screen(fakes, [tiered(fakes, i) for i in range(POLLS)], size)
    for seen in ("tiers below the device", "pool map", "█ used", "host", "disk", "? help"):
        assert seen in text, text
    # 118 tokens/s reused in all; the split over the last 10 s: device 25 %, host 68 %, disk 7 %
    assert "118 tok/s" in text
    assert ("dev 25 % host 68 % disk 7 %" if size[0] == 80 else "device 25.4 %") in text
    assert "✖2" in text if size[0] == 80 else "disk failures: load checksum 2" in text


async def test_an_agent_without_tiers_has_no_tier_panel(fakes) -> None:
    text = await screen(fakes, [fakes.reading(A)], (100, 34))
    assert "tiers below the device" not in text
    assert "pool map" in text


def test_rates_cover_the_last_ten_seconds_and_restart_with_the_agent(fakes) -> None:
    window = RateWindow(seconds=10.0)
    for i in range(4):
        window.add(tiered(fakes, i).pool)
    rates = window.rates()
    assert rates is not None and rates.seconds == 10.0
    assert rates.hits_tokens == pytest.approx(118.0)
    assert rates.hits_by_tier == pytest.approx({"device": 30.0, "host": 80.0, "disk": 8.0})
    assert rates.loaded_bytes["host"] == pytest.approx(80 / 16 * PAGE)
    window.add(tiered(fakes, 0, timestamp=NOW + 100).pool)  # counters back to the start
    assert window.rates() is None


def test_without_two_readings_the_rates_are_dashes_and_the_split_is_since_start(fakes) -> None:
    pool = tiered(fakes, 0).pool
    panel = TierPanel()
    panel.show(pool, None, stale=False)
    lines = fakes.widget_text(panel, 100)
    assert "saved   –" in lines and "(since start)" in lines
    assert "host  lru     2.44 GiB / 8 GiB     31 %      –       4 µs  26× cheaper" in lines
    narrow = "\n".join(str(line) for line in tier_lines(pool, None, 36)[:2])
    assert narrow.startswith("reused dev 71 % host 24 % disk 5 %")
