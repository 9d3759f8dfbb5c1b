"""What a load run measured: latency percentiles, throughput, errors, as a stable JSON shape.

Keys of `LoadReport.to_json()` (documented in the README): profile, seed, endpoint, mode, rate,
concurrency, duration_s, requests {sent, completed, failed, cancelled}, ttft_s and latency_s
{p50, p90, p99, max}, prompt_tokens {p50, p90, p99, max} (one request's prompt, in the model's
tokens as the agent counted them), tokens {prompt, cached_prompt (null when the agent does not
report it), output}, output_tokens_per_s, requests_per_s, errors {message: count}.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class RequestResult:
    """One request as the load generator saw it; times in seconds."""

    index: int
    latency: float
    ttft: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = 0  # None: the agent does not report it (--report-cached-tokens)
    completion_tokens: int = 0
    error: str | None = None
    cancelled: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled


def _cached(done: Sequence[RequestResult]) -> int | None:
    """Prompt tokens the agent found in its prefix cache; None when it does not say."""
    counts = [r.cached_tokens for r in done]
    return None if counts and all(c is None for c in counts) else sum(c or 0 for c in counts)


def percentile(
    values: Sequence[float], q: float, method: Literal["linear", "nearest"] = "linear"
) -> float | None:
    """The q-th percentile (0..100); None for no values.

    `linear` interpolates between the two nearest values (the load report's latencies);
    `nearest` is the nearest rank, always one of the values (`kvctl simulate`'s queue times in
    whole steps)."""
    if not values:
        return None
    ordered = sorted(values)
    if method == "nearest":
        return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: Sequence[float]) -> dict[str, float | None]:
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


@dataclass(frozen=True)
class LoadReport:
    """The results of one run and how it was driven."""

    profile: str
    seed: int
    mode: str
    rate: float | None
    concurrency: int
    duration_s: float
    results: tuple[RequestResult, ...]
    stopped_by: str | None = None  # a signal's name when the run was stopped early
    endpoint: str = "/v1/completions"

    @property
    def completed(self) -> tuple[RequestResult, ...]:
        return tuple(r for r in self.results if r.ok)

    @property
    def failed(self) -> int:
        return sum(r.error is not None for r in self.results)

    @property
    def cancelled(self) -> int:
        return sum(r.cancelled for r in self.results)

    @property
    def output_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.results)

    def errors(self) -> dict[str, int]:
        """Error messages and how often each came, most frequent first."""
        return dict(Counter(r.error for r in self.results if r.error).most_common())

    def to_json(self) -> dict[str, Any]:
        done = self.completed
        wall = max(self.duration_s, 1e-9)
        return {
            "profile": self.profile,
            "seed": self.seed,
            "endpoint": self.endpoint,
            "mode": self.mode,
            "rate": self.rate,
            "concurrency": self.concurrency,
            "duration_s": self.duration_s,
            "stopped_by": self.stopped_by,
            "requests": {
                "sent": len(self.results),
                "completed": len(done),
                "failed": self.failed,
                "cancelled": self.cancelled,
            },
            "ttft_s": spread([r.ttft for r in done if r.ttft is not None]),
            "latency_s": spread([r.latency for r in done]),
            "prompt_tokens": spread([r.prompt_tokens for r in done if r.prompt_tokens]),
            "tokens": {
                "prompt": sum(r.prompt_tokens for r in done),
                "cached_prompt": _cached(done),
                "output": self.output_tokens,
            },
            "output_tokens_per_s": self.output_tokens / wall,
            "requests_per_s": len(done) / wall,
            "errors": self.errors(),
        }
