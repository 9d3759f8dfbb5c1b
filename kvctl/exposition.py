"""An engine's /metrics text, read into fleet figures: which engine it is, and one row per model.

Parsing is prometheus_client's own parser, so any exposition Prometheus can scrape reads here.
An engine serving several models (or several data-parallel ranks of one) labels its series
with the model's name; counts are summed over the ranks of a model and utilisation is the
highest rank's, the one that runs out first.

A single scrape has no window, so a ratio of counters (vLLM's prefix hits over queries, its
preemptions) is the one since the server started, and says so (`Figures.prefix_span`).
`kvctl top` reads twice and shows the ratio between its polls instead (`between`).

Reading is linear in the text and its memory follows what is kept: the text is read line by
line as it arrives (`ExpositionReader`), and only the series some engine's figures use
(`READ_SERIES`) reach the parser; their samples are indexed by model once, so each model's row
costs its own samples. A value no figure can be (NaN, ±Inf) is "–" with a note
(`kvctl.figures.sane`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TextIO, cast

from prometheus_client.parser import text_fd_to_metric_families

from kvctl.engines import ENGINES, KVCTL, KVCTL_MARKER, READ_SERIES, Engine
from kvctl.figures import Figures, from_source, ratio, sane

SINCE_START = "since start"


_NAME = re.compile(rb"[a-zA-Z_:][a-zA-Z0-9_:]*(?=[{ \t]|$)")


class ExpositionError(ValueError):
    """The text is not a Prometheus exposition."""


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


class Exposition:
    """The samples of one scrape that kvctl reads, by name, and by name and model on demand."""

    def __init__(self, samples: Iterable[Sample]) -> None:
        self._by_name: dict[str, list[Sample]] = defaultdict(list)
        self._by_model: dict[tuple[str, str], dict[str, list[Sample]]] = {}
        for sample in samples:
            self._by_name[sample.name].append(sample)

    @classmethod
    def parse(cls, text: str) -> Exposition:
        reader = ExpositionReader()
        reader.feed(text.encode())
        return reader.close()

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def series(self, name: str | None) -> list[Sample]:
        return [] if name is None else self._by_name.get(name, [])

    def of_model(self, name: str | None, label: str | None, model: str) -> list[Sample]:
        """The samples of `name` whose `label` is `model`, and those without it (which are
        every model's); grouped by `label` once per name."""
        if name is None:
            return []
        if label is None:
            return self.series(name)
        groups = self._by_model.get((name, label))
        if groups is None:
            groups = defaultdict(list)
            for sample in self.series(name):
                groups[sample.labels.get(label, "")].append(sample)
            self._by_model[(name, label)] = groups
        named = groups.get(model, []) if model else []
        return named + groups.get("", [])


class ExpositionReader:
    """An exposition read from chunks as they arrive: each line is checked to be a sample or a
    comment, and only the samples of `keep` (and their TYPE lines) are parsed and kept, so a
    huge exposition of other series costs a pass over its bytes, not memory. A counter written
    without its `_total` is kept too: the parser names its samples with it."""

    def __init__(self, keep: frozenset[str] = READ_SERIES) -> None:
        self._keep = keep | {name.removesuffix("_total") for name in keep}
        self._partial: list[bytes] = []
        self._kept: list[str] = []
        self._lines = 0

    def feed(self, chunk: bytes) -> None:
        lines = chunk.split(b"\n")
        if len(lines) > 1:
            self._line(b"".join([*self._partial, lines[0]]))
            self._partial = []
            for line in lines[1:-1]:
                self._line(line)
        if lines[-1]:
            self._partial.append(lines[-1])

    def _line(self, raw: bytes) -> None:
        self._lines += 1
        line = raw.strip()
        if line.startswith(b"#"):
            parts = line.split(None, 3)
            if (
                len(parts) > 2
                and parts[1] == b"TYPE"
                and parts[2].decode("ascii", "replace") in self._keep
            ):
                self._kept.append(line.decode(errors="replace"))
            return
        if not line:
            return
        match = _NAME.match(line)
        if match is None:
            shown = line[:40].decode(errors="replace")
            raise ExpositionError(
                f"not a Prometheus exposition: line {self._lines} ({shown!r}) is not a sample"
            )
        if match.group().decode() in self._keep:
            self._kept.append(line.decode(errors="replace"))

    def close(self) -> Exposition:
        """The exposition read (ExpositionError where a kept sample does not parse)."""
        if self._partial:
            self._line(b"".join(self._partial))
            self._partial = []
        lines, self._kept = self._kept, []  # the parser only iterates over its "file"
        try:
            samples = [
                Sample(s.name, s.labels, s.value)
                for family in text_fd_to_metric_families(cast(TextIO, iter(lines)))
                for s in family.samples
            ]
        except (ValueError, TypeError, IndexError) as error:
            raise ExpositionError(f"not a Prometheus exposition: {error}") from None
        return Exposition(samples)


def detect(exposition: Exposition) -> str | None:
    """The engine that wrote `exposition` ("kvctl" for an agent), None if none is known."""
    if KVCTL_MARKER in exposition:
        return KVCTL
    return next((e.name for e in ENGINES if e.marker in exposition), None)


@dataclass(frozen=True)
class ModelFigures:
    """One model's row of an engine."""

    model: str
    figures: Figures
    hits: float | None = None
    """The prefix counters behind the ratio, kept to take the next reading's ratio between."""
    queries: float | None = None
    notes: tuple[str, ...] = ()
    """Numbers of the source left out as nonsense (`kvctl.figures.sane`)."""


def engine_rows(engine: Engine, exposition: Exposition) -> list[ModelFigures]:
    """One row per model the engine serves (the model label's values, in order seen); one row
    named "" for an engine whose series name no model."""
    models = _models(engine, exposition)
    return [_row(engine, exposition, model) for model in models]


def between(previous: ModelFigures | None, current: ModelFigures) -> ModelFigures:
    """`current` with its prefix hit ratio taken since `previous` (a reading of the same
    model's counters), where queries were made in between; else as it is."""
    if previous is None or None in (previous.hits, current.hits):
        return current
    asked = (current.queries or 0) - (previous.queries or 0)
    if asked <= 0:
        return current
    hit = (current.hits or 0) - (previous.hits or 0)
    figures = replace(current.figures, prefix_hit_ratio=ratio(hit, asked), prefix_span="last poll")
    return replace(current, figures=figures)


def _models(engine: Engine, exposition: Exposition) -> list[str]:
    seen: dict[str, None] = {}
    for sample in exposition.series(engine.marker):
        seen[_model_of(engine, sample)] = None
    return list(seen) or [""]


def _model_of(engine: Engine, sample: Sample) -> str:
    return "" if engine.model_label is None else sample.labels.get(engine.model_label, "")


def _sum(engine: Engine, exposition: Exposition, name: str | None, model: str) -> float | None:
    samples = exposition.of_model(name, engine.model_label, model)
    return sum(s.value for s in samples) if samples else None


def _highest(engine: Engine, exposition: Exposition, name: str | None, model: str) -> float | None:
    samples = exposition.of_model(name, engine.model_label, model)
    return max(s.value for s in samples) if samples else None


def _row(engine: Engine, exposition: Exposition, model: str) -> ModelFigures:
    def total(name: str | None) -> float | None:
        return _sum(engine, exposition, name, model)

    hits, hits_note = sane("prefix_cache_hits", total(engine.prefix.hits))
    queries, queries_note = sane("prefix_cache_queries", total(engine.prefix.queries))
    usage = _highest(engine, exposition, engine.utilization, model)
    if engine.prefix.gauge is not None:
        prefix = _highest(engine, exposition, engine.prefix.gauge, model)
        span = "engine's own" if prefix is not None else None
    else:
        prefix, span = ratio(hits, queries), SINCE_START
    preemptions = total(engine.preemptions)
    figures, notes = from_source(
        {
            "utilization_ratio": usage,
            "pressure_ratio": usage,
            "prefix_hit_ratio": prefix,
            "requests_running": total(engine.running),
            "requests_waiting": total(engine.waiting),
            "preemptions": preemptions,
            **_capacity(engine, exposition, model),
        },
        prefix_span=span,
        preemptions_span=None if preemptions is None else SINCE_START,
    )
    said = tuple(note for note in (hits_note, queries_note) if note) + notes
    if model and said:
        said = tuple(f"{model}: {note}" for note in said)
    return ModelFigures(model, figures, hits, queries, said)


def _capacity(engine: Engine, exposition: Exposition, model: str) -> dict[str, float | None]:
    """Tokens per block, blocks, and tokens of KV, as the engine reports them (None where it
    does not say)."""
    spec = engine.capacity
    block_tokens = blocks = None
    if spec.info is not None:
        for sample in exposition.of_model(spec.info, engine.model_label, model):
            block_tokens = _label_number(sample, spec.block_size_label)
            blocks = _label_number(sample, spec.blocks_label)
    else:
        block_tokens = _highest(engine, exposition, spec.block_size, model)
        blocks = _sum(engine, exposition, spec.blocks, model)
    tokens = _sum(engine, exposition, spec.tokens, model)
    return {"block_tokens": block_tokens, "blocks": blocks, "capacity_tokens": tokens}


def _label_number(sample: Sample, label: str | None) -> float | None:
    text = None if label is None else sample.labels.get(label)
    try:
        return None if text is None else float(text)
    except ValueError:
        return None
