"""Three models' KV pools sharing one budget: the agent's rebalancer against a static split.

Runs `kvctl simulate --scenario budget` (`kvctl/simulate/budget.py`: Llama-2-70B, Mistral-7B and
Gemma-2B sharing one GPU's KV memory, on real `PagePool`s with `AutoDefrag` and `PoolResizer`,
the rebalancing side under the agent's `KvBudget` and `Rebalancer` with its default settings)
over several seeds per load mix. Each seed is one request stream, replayed on both sides (paired
seeds): the per-seed ratio and difference (rebalancing against static) cancel what the stream
itself does, and their median with min–max says how far to trust them. The figures are counts in
simulated steps, not timings, so they are the same on every machine; only the run time is not.

Per mix and metric: static and rebalancing as median (min–max) over the seeds, the paired ratio
and difference, and in how many seeds rebalancing was better, equal or worse. The target (the
issue's): rebalancing at least as good as static on every mix (median of the paired difference
no worse on failure rate, preemptions, utilisation and p99 queue time), and better where load
moves (`moving`: better on at least one of them). The exit status says whether it was met.

    python benchmarks/budget_rebalance.py [--seeds 7] [--mix one-hot --mix moving ...]
        [--requests N] [--budget-fraction F] [--set headroom_ratio=0.3 ...]

`--set KEY=NUMBER` changes one of the rebalancer's settings (`RebalanceSettings`) from its
default, to try a change against the same seeds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paired import MIN_ROUNDS, command_line, environment, finish, spread, verdict

from kvctl.settings import RebalanceSettings
from kvctl.simulate.budget import MIXES, STEP_SECONDS, run_budget


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    lower_is_better: bool
    scale: float = 1.0
    fmt: str = ".0f"
    judged: bool = True  # part of the target
    counted: bool = True  # better/equal/worse seeds shown (not for what static never does)


METRICS = (
    Metric("alloc_failure_rate", "alloc failure rate, %", True, 100, ".3f"),
    Metric("preemptions", "preemptions", True),
    Metric("recomputed_bytes", "KV dropped by preemptions, GiB", True, 2**-30, ".1f", False),
    Metric("utilization_mean", "utilisation of the budget, %", False, 100, ".1f"),
    Metric("queue_p99_steps", "p99 queue time, steps", True),
    Metric("queue_mean_steps", "mean queue time, steps", True, fmt=".1f", judged=False),
    Metric("finished_in_load", "finished by the last arrival", False, judged=False),
    Metric("steps", "steps to drain", True, judged=False),
    Metric("rebalances", "rebalances", True, judged=False, counted=False),
    Metric("moved_bytes", "moved, GiB", True, 2**-30, ".1f", judged=False, counted=False),
)


def _ratio(a: float, b: float) -> float | None:
    if b:
        return a / b
    return 1.0 if a == 0 else None


def _signed(values: list[float], fmt: str) -> str:
    """`median (min to max)` with signs, for differences."""
    v = sorted(values)
    return f"{statistics.median(v):+{fmt}} ({v[0]:+{fmt}} to {v[-1]:+{fmt}})"


def report(mix: str, runs: list[dict[str, Any]]) -> tuple[bool, list[str]]:
    """Print one mix's table; whether the target held on it, and which metrics failed it."""
    static = [run["results"]["static"] for run in runs]
    rebal = [run["results"]["rebalancing"] for run in runs]
    budget = statistics.median(s["budget_bytes"] for s in static) / 2**30
    requests = spread([s["requests"] for s in static], fmt=".0f")
    print(f"\n## {mix}: {len(runs)} seeds, {requests} requests, budget {budget:.1f} GiB (median)")
    print(
        f"{'metric':32} {'static':>22} {'rebalancing':>22} {'ratio r/s':>20} "
        f"{'difference r-s':>26} {'r better/=/worse':>16}"
    )
    worse_on: list[str] = []
    better_on: list[str] = []
    for m in METRICS:
        a = [r[m.key] for r in rebal]
        b = [s[m.key] for s in static]
        diffs = [(x - y) * m.scale for x, y in zip(a, b, strict=True)]
        ratios = [_ratio(x, y) for x, y in zip(a, b, strict=True)]
        ratio = spread([r for r in ratios if r is not None]) if None not in ratios else "n/a"
        sign = 1 if m.lower_is_better else -1
        better = sum(1 for d in diffs if sign * d < 0)
        worse = sum(1 for d in diffs if sign * d > 0)
        print(
            f"{m.label:32} {spread(b, m.scale, m.fmt):>22} {spread(a, m.scale, m.fmt):>22} "
            f"{ratio:>20} {_signed(diffs, m.fmt):>26} "
            f"{f'{better}/{len(diffs) - better - worse}/{worse}' if m.counted else '':>16}"
        )
        median = sign * statistics.median(diffs)
        if m.judged and median > 0:
            worse_on.append(m.label)
        if m.judged and median < 0:
            better_on.append(m.label)
    models = list(static[0]["models"])
    for name in models:
        parts = []
        for label, side in (("static", static), ("rebalancing", rebal)):
            share = spread([s["models"][name]["share_mean"] for s in side], 100, ".0f")
            pre = spread([s["models"][name]["preemptions"] for s in side], fmt=".0f")
            p99 = spread([s["models"][name]["queue_p99_steps"] for s in side], fmt=".0f")
            parts.append(f"{label}: share {share} %, preemptions {pre}, p99 queue {p99}")
        print(f"  {name:12} " + "; ".join(parts))
    met = not worse_on and (mix != "moving" or bool(better_on))
    print(
        f"target on {mix}: {verdict(met)}" + (f" (worse on {', '.join(worse_on)})" * bool(worse_on))
    )
    return met, worse_on


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--mix", action="append", choices=MIXES)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--budget-fraction", type=float, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=NUMBER")
    args = parser.parse_args(argv)
    changed = {k: float(v) for k, v in (item.split("=", 1) for item in args.set)}
    settings = RebalanceSettings(**changed) if changed else None
    if args.seeds < MIN_ROUNDS:
        parser.error(f"--seeds {args.seeds}: at least {MIN_ROUNDS}, or the spread says little")
    mixes = args.mix or list(MIXES)
    print(environment())
    print(command_line())
    print(
        f"# one step = 16 decode tokens = {STEP_SECONDS} s of the rebalancer's clock; "
        f"RebalanceSettings: {'defaults' if settings is None else changed}; seeds 0.."
        f"{args.seeds - 1}, each replayed on both sides; r better/=/worse counts seeds"
    )
    started = time.perf_counter()
    met = True
    timings: list[float] = []
    run: Callable[[str, int], dict[str, Any]] = lambda mix, seed: run_budget(  # noqa: E731
        seed,
        mix=mix,
        requests=args.requests,
        budget_fraction=args.budget_fraction,
        rebalance=settings,
    )
    for mix in mixes:
        runs = []
        for seed in range(args.seeds):
            t = time.perf_counter()
            runs.append(run(mix, seed))
            timings.append(time.perf_counter() - t)
        ok, _ = report(mix, runs)
        met = met and ok
    print(
        f"\ntarget (rebalancing at least as good as static on every mix, better on moving): "
        f"{verdict(met)}"
    )
    print(
        f"# {len(timings)} runs of both sides in {time.perf_counter() - started:.0f} s "
        f"({spread(timings, fmt='.1f')} s a run)"
    )
    return finish(met)


if __name__ == "__main__":
    raise SystemExit(main())
