"""How tiers read in `kvctl pool show` and `kvctl status`: a row per tier after the split of
reused tokens, load cost against prefill, failures only when there are some, nothing at all for
an agent without tiers, and lines that fold at 80 columns instead of running off."""

from __future__ import annotations

import io

import pytest
from pool_readings import pool_snapshot, tier_reading
from rich.console import Console

from kvctl.api import TierReading
from kvctl.fleet import Reading
from kvctl.view import render
from kvctl.view.tiers import hit_shares, tier_rates, tier_rows, versus_prefill

PAGE = 64 << 10


def tier(name: str = "host", **fields) -> TierReading:
    """The shared tier of 1,024 pages of 64 KiB with 256 held, 1,600 tokens loaded from it."""
    busy = dict(
        page_bytes=PAGE, used_pages=256, hits_tokens_total=1600, stored_pages_total=300,
        stored_bytes_total=300 * PAGE, loaded_pages_total=100, loaded_bytes_total=100 * PAGE,
        store_seconds_total=0.01, load_seconds_total=0.0064,
    )  # fmt: skip
    return tier_reading(name, **{**busy, **fields})


def tiered(**fields):
    """The quiet pool (6,000 of 10,000 tokens reused) with 1,600 from host and 400 from disk."""
    tiers = [
        tier(),
        tier(
            "disk", capacity_pages=0, used_pages=0, hits_tokens_total=400, path="/srv/kv",
            filesystem_free_bytes=10 << 30, filesystem_size_bytes=100 << 30,
        ),
    ]  # fmt: skip
    numbers = dict(
        prefix_hits_tokens_by_tier={"device": 4000, "host": 1600, "disk": 400},
        tiers=tiers,
        prefill_seconds_per_token=1e-4,
    )
    return pool_snapshot(**{**numbers, **fields})


def rendered(renderable: object, width: int = 200) -> str:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(renderable)
    return out.getvalue()


def test_no_tiers_no_rows() -> None:
    assert tier_rows(pool_snapshot()) == []
    assert "tier" not in rendered(render.pool_table(pool_snapshot()))


def test_a_row_per_tier_after_the_split() -> None:
    text = rendered(render.pool_table(tiered()))
    assert (
        "tiers      reused 6,000 of 10,000 prompt tokens since start: device 66.7 %, "
        "host 26.7 %, disk 6.7 %; prefill 100 µs/token"
    ) in text
    assert (
        "host tier  lru; 256 of 1,024 pages, 16 MiB of 64 MiB (25 %); reused 1,600 tokens "
        "(26.7 %), loaded 100 pages (6.25 MiB) at 4 µs/token, 25× cheaper than prefill"
    ) in text
    assert "disk tier  lru; off (0 pages) in /srv/kv (filesystem 10 GiB free of 100 GiB)" in text
    assert "failures" not in text


def test_failures_show_when_there_are_some() -> None:
    broken = tier(load_failures_total={"checksum": 2, "io": 0}, store_failures_total={"full": 3})
    text = rendered(render.pool_table(tiered(tiers=[broken])))
    assert "failures: store full 3, load checksum 2" in text


def test_a_tier_dearer_than_prefill_says_so() -> None:
    assert str(versus_prefill(5e-4, 1e-4)) == "5× dearer than prefill"
    assert str(versus_prefill(1e-6, 1e-4, short=True)) == "100× cheaper"
    assert str(versus_prefill(None, 1e-4)) == ""
    text = rendered(render.pool_table(tiered(prefill_seconds_per_token=None)))
    assert "prefill not timed yet" in text and "cheaper" not in text


def test_status_of_one_agent_shows_the_tiers() -> None:
    reading = Reading(agent="http://node1:8477", pool=tiered())
    text = rendered(render.status([reading]))
    assert "host tier  lru;" in text and "disk tier  lru;" in text


def test_at_80_columns_the_rows_fold_within_the_width() -> None:
    lines = rendered(render.pool_table(tiered()), 80).splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    assert any(line.startswith("host tier  lru; ") for line in lines)


def test_shares_and_rates() -> None:
    assert hit_shares({"device": 3, "host": 1}, ["device", "host", "disk"]) == {
        "device": 0.75,
        "host": 0.25,
        "disk": 0.0,
    }
    assert hit_shares({}, ["device"]) == {"device": None}
    older = tiered()
    newer = tiered(
        timestamp=older.timestamp + 4,
        prefix_hits_tokens_total=6_400,
        prefix_queries_tokens_total=10_800,
        prefix_hits_tokens_by_tier={"device": 4100, "host": 1900, "disk": 400},
        tiers=[tier(loaded_bytes_total=120 * PAGE), older.tiers[1]],
    )
    rates = tier_rates(older, newer)
    assert rates is not None
    assert (rates.hits_tokens, rates.queries_tokens) == (100.0, 200.0)
    assert rates.hits_by_tier == {"device": 25.0, "host": 75.0, "disk": 0.0}
    assert rates.loaded_bytes["host"] == pytest.approx(5 * PAGE)
    assert tier_rates(newer, older) is None  # time went back: no rate
