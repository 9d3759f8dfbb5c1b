"""Paired, interleaved rounds and the report every benchmark prints.

Why paired rounds: timings on a shared VM drift by tens of percent from one second to the next.
Running ours and the baseline back to back (A, B, A, B, ...) and taking the ratio *within* each
round cancels most of that drift; the median of the per-round ratios, with their min and max,
says both what the figure is and how far to trust it. Every benchmark also prints the torch
thread count and the load average, since both change the figures more than most code changes.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIN_ROUNDS = 7


def environment() -> str:
    """One line: the command, Python, torch and its thread count, cores, load average."""
    parts = [f"python {platform.python_version()}"]
    torch = sys.modules.get("torch")
    if torch is not None:
        parts.append(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    else:
        parts.append("no torch (this benchmark runs no torch code)")
    parts.append(f"{os.cpu_count()} cores")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    parts.append(f"load average {load}")
    return "# " + "; ".join(parts)


def load_average() -> str:
    """The closing line of every benchmark: how busy the machine was while it ran."""
    return f"# load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}"


def verdict(met: bool) -> str:
    """How a benchmark's target came out, in the words every benchmark prints."""
    return "met" if met else "NOT met"


def finish(met: bool) -> int:
    """Print the closing load-average line; the exit status says whether the target was met."""
    print(load_average())
    return 0 if met else 1


def command_line() -> str:
    return "command: python " + " ".join([sys.argv[0], *sys.argv[1:]])


@dataclass(frozen=True)
class Paired:
    """Per-round measurements of two sides and their per-round ratios (ours / baseline)."""

    ours: list[float]
    base: list[float]

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.ours, self.base, strict=True)]

    def ratio_summary(self) -> str:
        r = sorted(self.ratios)
        median = statistics.median(r)
        return f"{median:.2f}x (median of {len(r)} rounds, {r[0]:.2f}x to {r[-1]:.2f}x)"

    @property
    def median_ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def worst_ratio(self) -> float:
        return min(self.ratios)


def paired_rounds(
    ours: Callable[[], float], base: Callable[[], float], rounds: int = MIN_ROUNDS
) -> Paired:
    """Run `ours` and `base` alternately `rounds` times each (A, B, A, B, ...).

    Each callable does the work once and returns its measurement (a rate or a time; the caller
    knows which way is better). The order alternates every round so neither side always runs
    on a warm cache.
    """
    if rounds < MIN_ROUNDS:
        raise ValueError(f"{rounds} rounds: at least {MIN_ROUNDS} pairs, or the spread says little")
    a: list[float] = []
    b: list[float] = []
    for i in range(rounds):
        if i % 2:
            b.append(base())
            a.append(ours())
        else:
            a.append(ours())
            b.append(base())
    return Paired(a, b)


def spread(values: Sequence[float], scale: float = 1.0, fmt: str = ".2f") -> str:
    """`median (min–max)` of values multiplied by `scale`."""
    v = sorted(x * scale for x in values)
    return f"{statistics.median(v):{fmt}} ({v[0]:{fmt}}-{v[-1]:{fmt}})"
