"""An engine's /metrics text, read into fleet figures: which engine it is, and one row per model.

Parsing is prometheus_client's own parser, so any exposition Prometheus can scrape reads here.
An engine serving several models (or several data-parallel ranks of one) labels its series
with the model's name; counts are summed over the ranks of a model and utilisation is the
highest rank's, the one that runs out first.

A single scrape has no window, so a ratio of counters (vLLM's prefix hits over queries, its
preemptions) is the one since the server started, and says so (`Figures.prefix_span`).
`kvctl top` reads twice and shows the ratio between its polls instead (`between`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

from kvctl.engines import ENGINES, KVCTL, KVCTL_MARKER, Engine
from kvctl.figures import Figures, ratio

SINCE_START = "since start"


class ExpositionError(ValueError):
    """The text is not a Prometheus exposition."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


class Exposition:
    """Every sample of one scrape, by name."""

    def __init__(self, samples: Iterable[Sample]) -> None:
        self._by_name: dict[str, list[Sample]] = defaultdict(list)
        for sample in samples:
            self._by_name[sample.name].append(sample)

    @classmethod
    def parse(cls, text: str) -> Exposition:
        try:
            samples = [
                Sample(s.name, dict(s.labels), s.value)
                for family in text_string_to_metric_families(text)
                for s in family.samples
            ]
        except (ValueError, TypeError, IndexError) as error:
            raise ExpositionError(f"not a Prometheus exposition: {error}") from None
        return cls(samples)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def series(self, name: str | None) -> list[Sample]:
        return [] if name is None else self._by_name.get(name, [])


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


def _of(engine: Engine, exposition: Exposition, name: str | None, model: str) -> list[Sample]:
    return [s for s in exposition.series(name) if _model_of(engine, s) in ("", model)]


def _sum(engine: Engine, exposition: Exposition, name: str | None, model: str) -> float | None:
    samples = _of(engine, exposition, name, model)
    return sum(s.value for s in samples) if samples else None


def _highest(engine: Engine, exposition: Exposition, name: str | None, model: str) -> float | None:
    samples = _of(engine, exposition, name, model)
    return max(s.value for s in samples) if samples else None


def _count(value: float | None) -> int | None:
    return None if value is None else round(value)


def _row(engine: Engine, exposition: Exposition, model: str) -> ModelFigures:
    def total(name: str | None) -> float | None:
        return _sum(engine, exposition, name, model)

    usage = _highest(engine, exposition, engine.utilization, model)
    hits, queries = total(engine.prefix.hits), total(engine.prefix.queries)
    if engine.prefix.gauge is not None:
        prefix = _highest(engine, exposition, engine.prefix.gauge, model)
        span = "engine's own" if prefix is not None else None
    else:
        prefix, span = ratio(hits, queries), SINCE_START
    preemptions = total(engine.preemptions)
    block_tokens, blocks, tokens = _capacity(engine, exposition, model)
    figures = Figures(
        utilization_ratio=usage,
        pressure_ratio=usage,
        prefix_hit_ratio=prefix,
        prefix_span=span,
        requests_running=_count(total(engine.running)),
        requests_waiting=_count(total(engine.waiting)),
        preemptions=preemptions,
        preemptions_span=None if preemptions is None else SINCE_START,
        capacity_tokens=tokens,
        block_tokens=block_tokens,
        blocks=blocks,
    )
    return ModelFigures(model, figures, hits, queries)


def _capacity(
    engine: Engine, exposition: Exposition, model: str
) -> tuple[int | None, int | None, int | None]:
    """Tokens per block, blocks, and tokens of KV (None where the engine does not say)."""
    spec = engine.capacity
    block_tokens = blocks = None
    if spec.info is not None:
        for sample in _of(engine, exposition, spec.info, model):
            block_tokens = _label_int(sample, spec.block_size_label)
            blocks = _label_int(sample, spec.blocks_label)
    else:
        block_tokens = _count(_highest(engine, exposition, spec.block_size, model))
        blocks = _count(_sum(engine, exposition, spec.blocks, model))
    tokens = _count(_sum(engine, exposition, spec.tokens, model))
    if tokens is None and block_tokens is not None and blocks is not None:
        tokens = block_tokens * blocks
    return block_tokens, blocks, tokens


def _label_int(sample: Sample, label: str | None) -> int | None:
    text = None if label is None else sample.labels.get(label)
    try:
        return None if text is None else int(float(text))
    except ValueError:
        return None
