"""kvctl/engines.py checked against /metrics text of the engines themselves.

tests/fixtures/expositions holds, per engine and version, what a server's /metrics answered
(vLLM and kvctl agents, recorded) or what the engine's own metric code writes (SGLang and
TensorRT-LLM, built from their source; README.md there says how each file was made). Every
name the table gives an engine must be in that engine's expositions, of the right type and
with a plausible value, and no exposition may carry another engine's marker, so that reading
one (`kvctl.exposition.detect`) is never ambiguous.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvctl import engines
from kvctl.engines import ENGINES, KVCTL, KVCTL_MARKER, Engine
from kvctl.exposition import Exposition, detect

FIXTURES = Path(__file__).parent / "fixtures" / "expositions"
FILES = sorted(FIXTURES.glob("*.txt"))
README = (FIXTURES / "README.md").read_text()


def engine_of(path: Path) -> str:
    """The engine a fixture's name starts with ("vllm" for vllm-0.32.0-busy.txt)."""
    return path.name.split("-", 1)[0]


ENGINE_FILES = [p for p in FILES if engine_of(p) != KVCTL]
KVCTL_FILES = [p for p in FILES if engine_of(p) == KVCTL]


class Scrape:
    """One fixture's samples by sample name, with the type of the family each belongs to."""

    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        self.samples: dict[str, list] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.types[sample.name] = family.type
                self.samples[sample.name].append(sample)

    def values(self, name: str, kind: str) -> list[float]:
        """Every value of `name`, which must be there, as a sample of a `kind` family."""
        assert name in self.samples, f"{name} is not in the exposition"
        assert self.types[name] == kind, f"{name} is a {self.types[name]}, not a {kind}"
        values = [s.value for s in self.samples[name]]
        assert all(math.isfinite(v) for v in values), f"{name}: {values}"
        return values


def scrape(path: Path) -> Scrape:
    return Scrape(path.read_text())


def test_there_is_a_fixture_of_every_engine_and_of_kvctl():
    assert {engine_of(p) for p in FILES} == {KVCTL, *(e.name for e in ENGINES)}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_fixture_is_plain_exposition_text_and_described(path: Path):
    """Provenance lives in README.md, never in the text a parser reads: the only comments are
    prometheus_client's HELP and TYPE lines."""
    lines = path.read_text().splitlines()
    assert lines, f"{path.name} is empty"
    comments = [line for line in lines if line.startswith("#")]
    assert all(line.startswith(("# HELP ", "# TYPE ")) for line in comments)
    assert lines[0].startswith("# HELP ")
    assert f"`{path.name}`" in README, f"README.md does not describe {path.name}"


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: p.name)
def test_fixture_is_of_the_version_the_table_names(path: Path):
    engine = engines.engine_named(engine_of(path))
    assert path.name.startswith(f"{engine.name}-{engine.version.replace('@', '-')}")


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: p.name)
def test_every_name_of_the_engine_is_there_with_a_plausible_value(path: Path):
    engine = engines.engine_named(engine_of(path))
    s = scrape(path)

    markers = s.samples.get(engine.marker, [])
    assert markers, f"no {engine.marker} (the marker) in {path.name}"
    if engine.model_label is not None:
        assert all(m.labels.get(engine.model_label) for m in markers), engine.model_label

    if engine.utilization is not None:
        assert all(0 <= v <= 1 for v in s.values(engine.utilization, "gauge"))
    for name in (engine.waiting, engine.running):
        if name is not None:
            assert all(v >= 0 and v == int(v) for v in s.values(name, "gauge")), name
    if engine.preemptions is not None:
        assert all(v >= 0 for v in s.values(engine.preemptions, "counter"))

    prefix = engine.prefix
    if prefix.hits is not None or prefix.queries is not None:
        hits = s.values(prefix.hits, "counter")
        queries = s.values(prefix.queries, "counter")
        assert all(v >= 0 for v in hits + queries)
        assert sum(hits) <= sum(queries)
    if prefix.gauge is not None:
        assert all(0 <= v <= 1 for v in s.values(prefix.gauge, "gauge"))

    capacity = engine.capacity
    if capacity.info is not None:
        assert capacity.block_size_label and capacity.blocks_label
        s.values(capacity.info, "gauge")
        for info in s.samples[capacity.info]:
            assert int(info.labels[capacity.block_size_label]) > 0
            assert int(info.labels[capacity.blocks_label]) > 0
    for name in (capacity.block_size, capacity.blocks, capacity.tokens):
        if name is not None:
            assert all(v > 0 for v in s.values(name, "gauge")), name
    assert capacity.info or capacity.tokens or (capacity.block_size and capacity.blocks)


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: p.name)
def test_a_figure_the_table_leaves_out_is_not_exported(path: Path):
    """None in the table means the engine has no such counter, not that it was missed."""
    engine = engines.engine_named(engine_of(path))
    if engine.preemptions is None:
        counters = [n for n, kind in scrape(path).types.items() if kind == "counter"]
        assert not [n for n in counters if "preempt" in n or "retract" in n]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_only_its_own_marker_is_there(path: Path):
    names = set(scrape(path).samples)
    own = engine_of(path)
    markers = {KVCTL: KVCTL_MARKER} | {e.name: e.marker for e in ENGINES}
    assert markers[own] in names
    assert not [m for name, m in markers.items() if name != own and m in names]
    assert detect(Exposition.parse(path.read_text())) == own


@pytest.mark.parametrize("path", KVCTL_FILES, ids=lambda p: p.name)
def test_a_kvctl_agent_names_its_pools(path: Path):
    capacity = scrape(path).values(KVCTL_MARKER, "gauge")
    assert capacity and all(v > 0 for v in capacity)
    pools = {sample.labels["pool"] for sample in scrape(path).samples[KVCTL_MARKER]}
    assert len(pools) == (2 if "two-models" in path.name else 1)


def test_the_table_reads_each_engine_once():
    """One engine per name and per marker, so detection cannot pick two."""
    assert len({e.name for e in ENGINES}) == len({e.marker for e in ENGINES}) == len(ENGINES)
    assert KVCTL_MARKER not in {e.marker for e in ENGINES}


def names_of(engine: Engine) -> list[str]:
    c, p = engine.capacity, engine.prefix
    named = (engine.marker, engine.utilization, engine.waiting, engine.running)
    more = (engine.preemptions, p.hits, p.queries, p.gauge, c.info, c.block_size, c.blocks)
    return [n for n in (*named, *more, c.tokens) if n is not None]


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.name)
def test_names_carry_the_engines_prefix(engine: Engine):
    """vLLM and SGLang prefix with `name:`, TensorRT-LLM with `trtllm_`; counters end in
    `_total` as prometheus_client writes them."""
    prefix = "trtllm_" if engine.name == "trtllm" else f"{engine.name}:"
    assert all(n.startswith(prefix) for n in names_of(engine))
    counters = [engine.preemptions, engine.prefix.hits, engine.prefix.queries]
    assert all(n.endswith("_total") for n in counters if n is not None)
