"""What a pool holds, as `kvctl pool show` and the agent's start-up log say it."""

from __future__ import annotations

import io
import logging

import pytest
from pool_readings import pool_snapshot
from rich.console import Console

from kvctl.sizing import PoolFit
from kvctl.view.render import sizing_table

MIB = 1 << 20


def text(renderable) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(renderable)
    return out.getvalue()


def test_pool_fit_is_the_smaller_of_pool_and_context() -> None:
    fit = PoolFit(page_size=16, bytes_per_page=MIB, pages=64, context=4096)
    assert fit.tokens == 1024 and fit.largest_request == 1024 and fit.short_of_context
    assert fit.pages_for(4096) == 256 and fit.pages_for_contexts(3) == 768
    assert fit.concurrent(100) == 9  # 7 pages each
    roomy = PoolFit(16, MIB, 1024, 4096)
    assert roomy.largest_request == 4096 and not roomy.short_of_context
    assert PoolFit(16, MIB, 64).largest_request == 1024  # context unknown: the pool


def test_a_pool_of_page_groups_holds_a_block_of_tokens_in_every_group() -> None:
    """A model whose sliding layers keep pages of their own takes a page per group for each
    block of tokens at admission: 7 groups, 448 pages hold 64 blocks, 1,024 tokens."""
    fit = PoolFit(16, MIB, 448, 4096, groups=7)
    assert fit.tokens == 1024 and fit.short_of_context
    assert fit.pages_for(4096) == 256 * 7 and fit.concurrent(100) == 9


def test_pool_show_says_what_the_pool_holds() -> None:
    pool = pool_snapshot(
        page_size=16, bytes_per_page=MIB, capacity_pages=512, segment_pages=64,
        used_pages=0, cached_pages=0, max_pool_pages=1024,
        prompt_tokens_total=900, generation_tokens_total=100,
        requests_finished_total={"stop": 3, "length": 1},
    )  # fmt: skip
    shown = text(sizing_table(pool, context=2048, requests=8))
    assert "8,192 tokens, 4 requests of the full 2,048-token context" in shown
    assert "32 of 250 tokens (the mean so far)" in shown
    assert "2,048 tokens (prompt + max_tokens; the model's context)" in shown
    assert "8 full contexts at once: 1,024 pages (1 GiB); kvctl pool resize --pages 1024" in shown
    bigger = text(sizing_table(pool, context=2048, requests=9))
    assert "1,152 pages" in bigger and "restart with --max-pool-pages" in bigger


def test_pool_show_without_the_context_says_so() -> None:
    pool = pool_snapshot(page_size=16, bytes_per_page=MIB, capacity_pages=64, segment_pages=32)
    shown = text(sizing_table(pool, context=None))
    assert "1,024 tokens (prompt + max_tokens; the pool)" in shown
    assert "context is unknown" in shown


@pytest.mark.parametrize(("pages", "warns"), [(64, True), (256, False)])
def test_agent_logs_its_pool_and_warns_below_the_context(caplog, pages, warns) -> None:
    from kvctl.agent.startup.planning import log_pool_size

    caplog.set_level(logging.INFO, logger="kvctl.agent")
    log_pool_size(PoolFit(16, 64 << 10, pages, 4096))
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert info == [
        f"pool: {pages} pages of 16 tokens, 64 KiB each ({pages // 16} MiB): {pages * 16:,} "
        f"tokens; largest request {min(pages * 16, 4096):,} tokens (prompt + max_tokens, "
        f"{'the pool' if warns else 'the model' + chr(39) + 's context'})"
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warnings) is warns
    if warns:
        assert "fewer than the model's context of 4,096" in warnings[0]
        assert "--pool-pages 256 or --pool-memory 16MiB" in warnings[0]
