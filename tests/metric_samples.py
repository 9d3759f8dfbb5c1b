"""The `kvctl_*` samples of an exposition, by name and labels, for tests that compare scrapes."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def kvctl_samples(text: str) -> Samples:
    """Every `kvctl_*` sample of `text`; a duplicate series fails (the exposition is invalid)."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("kvctl_"):
                key = (s.name, frozenset(s.labels.items()))
                assert key not in samples, f"duplicate series {key}"
                samples[key] = s.value
    return samples
