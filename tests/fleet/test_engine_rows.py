"""Engines' expositions, recorded from real servers, read into fleet rows: every figure is the
engine's own number, "–" where it exports none, and never a figure of another engine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rich.console import Console

from kvctl.engines import KVCTL, SGLANG, TRTLLM, VLLM, split_engine
from kvctl.exposition import Exposition, ModelFigures, between, detect, engine_rows
from kvctl.figures import Figures
from kvctl.fleet import Reading
from kvctl.view import engine as engine_view
from kvctl.view.render import FleetTable

FIXTURES = Path(__file__).parent.parent / "fixtures" / "expositions"
VLLM_BUSY = FIXTURES / "vllm-0.32.0-busy.txt"
SGLANG_FILE = FIXTURES / "sglang-0.5.23-from-source.txt"
TRTLLM_FILE = FIXTURES / "trtllm-main-050f80de-from-source.txt"


def value(text: str, name: str, label: str = "") -> float:
    """A sample's value read with a regex, apart from the parser under test."""
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*{re.escape(label)}[^}}]*\}} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def rendered(renderable: object, width: int = 160) -> str:
    console = Console(width=width, record=True, file=None, force_terminal=False)
    with console.capture() as capture:
        console.print(renderable)
    return capture.get()


def one_row(path: Path) -> tuple[str | None, ModelFigures]:
    exposition = Exposition.parse(path.read_text())
    engine = detect(exposition)
    spec = {"vllm": VLLM, "sglang": SGLANG, "trtllm": TRTLLM}[engine or ""]
    (row,) = engine_rows(spec, exposition)
    return engine, row


def test_vllm_figures_are_its_own_numbers() -> None:
    text = VLLM_BUSY.read_text()
    engine, row = one_row(VLLM_BUSY)
    figures = row.figures
    assert engine == "vllm" and row.model == "smollm"
    assert figures.utilization_ratio == value(text, "vllm:kv_cache_usage_perc")
    hits = value(text, "vllm:prefix_cache_hits_total")
    queries = value(text, "vllm:prefix_cache_queries_total")
    assert figures.prefix_hit_ratio == pytest.approx(hits / queries)
    assert figures.prefix_span == "since start"  # one scrape has no window
    assert figures.preemptions == value(text, "vllm:num_preemptions_total")
    assert figures.requests_running == value(text, "vllm:num_requests_running")
    assert figures.requests_waiting == value(text, "vllm:num_requests_waiting")
    assert (figures.block_tokens, figures.blocks, figures.capacity_tokens) == (32, 40, 1280)
    assert figures.fragmentation_ratio is None and figures.alloc_success_ratio is None


def test_sglang_and_trtllm_read_their_gauges() -> None:
    text = SGLANG_FILE.read_text()
    engine, row = one_row(SGLANG_FILE)
    assert engine == "sglang"
    assert row.figures.prefix_hit_ratio == value(text, "sglang:cache_hit_rate")
    assert row.figures.prefix_span == "engine's own"
    assert row.figures.capacity_tokens == value(text, "sglang:max_total_num_tokens")
    assert row.figures.preemptions == value(text, "sglang:num_retracted_requests_total")
    text = TRTLLM_FILE.read_text()
    engine, row = one_row(TRTLLM_FILE)
    assert engine == "trtllm"
    blocks = value(text, "trtllm_kv_cache_max_blocks")
    assert row.figures.capacity_tokens == blocks * value(text, "trtllm_kv_cache_tokens_per_block")
    assert row.figures.preemptions is None  # it exports none: not a zero


def test_an_agent_exposition_is_recognised_as_kvctl() -> None:
    assert detect(Exposition.parse((FIXTURES / "kvctl-0.1.0-busy.txt").read_text())) == KVCTL
    assert detect(Exposition.parse("# TYPE up gauge\nup 1\n")) is None


def test_models_are_rows_and_ranks_of_one_model_add_up() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="a"} 2',
            'vllm:num_requests_running{engine="1",model_name="a"} 3',
            'vllm:num_requests_running{engine="0",model_name="b"} 1',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            'vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.2',
            'vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.7',
            "",
        ]
    )
    rows = engine_rows(VLLM, Exposition.parse(text))
    assert [row.model for row in rows] == ["a", "b"]
    assert rows[0].figures.requests_running == 5  # summed over its ranks
    assert rows[0].figures.utilization_ratio == 0.7  # the rank that runs out first
    assert rows[1].figures.utilization_ratio is None  # b exports no usage: not a's
    reading = Reading(agent="http://n:8000", engine="vllm", figures=rows[0].figures,
                      models=tuple(rows), model="a", source="metrics")  # fmt: skip
    assert [r.row_name for r in reading.per_pool()] == ["a", "b"]
    assert reading.for_pool("b").row_figures == rows[1].figures


def test_between_two_polls_the_ratio_is_of_what_was_asked_in_between() -> None:
    before = ModelFigures("m", Figures(prefix_hit_ratio=0.5), hits=50, queries=100)
    after = ModelFigures("m", Figures(prefix_hit_ratio=0.4), hits=60, queries=150)
    assert between(before, after).figures.prefix_hit_ratio == pytest.approx(10 / 50)
    assert between(before, after).figures.prefix_span == "last poll"
    idle = ModelFigures("m", Figures(prefix_hit_ratio=0.5), hits=50, queries=100)
    assert between(before, idle) == idle  # nothing asked: the ratio since start stays


def test_the_fleet_row_of_an_engine_shows_dashes_for_what_it_does_not_export() -> None:
    _, row = one_row(VLLM_BUSY)
    reading = Reading(
        agent="http://vllm-1:8000", engine="vllm", figures=row.figures, model="smollm",
        source="metrics", notes=VLLM.pitfalls,
    )  # fmt: skip
    (line,) = [ln for ln in rendered(FleetTable([reading])).splitlines() if "vllm-1" in ln]
    cells = line.split()
    assert "vLLM" in cells and "smollm" in cells
    assert "59.0" in cells and "33.3" in cells  # utilisation, prefix (768 of 2,304)
    assert cells[-1] == "–"  # alerts: none were read, which is not "none"
    assert cells.count("–") == 3  # frag, alloc ok, alerts
    detail = rendered(engine_view.detail(reading))
    assert "fragmentation  –  not exported" in detail
    assert "alloc success  –  not exported" in detail
    assert "1,280 tok (40 blocks of 32 tokens)" in detail
    assert "since start" in detail and "cached prefix blocks" in detail


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("vllm+http://node:8000", ("vllm", "http://node:8000")),
        ("SGLang+https://node", ("sglang", "https://node")),
        ("kvctl+http://node:8477", ("kvctl", "http://node:8477")),
        ("http://node:8000", (None, "http://node:8000")),
        ("node+1:8000", (None, "node+1:8000")),
    ],
)
def test_an_engine_is_named_before_the_scheme(text: str, expected: tuple) -> None:
    assert split_engine(text) == expected


def test_an_unknown_engine_is_one_line_naming_those_known() -> None:
    with pytest.raises(ValueError, match="unknown engine 'tgi': expected one of kvctl, vllm"):
        split_engine("tgi+http://node:8000")
