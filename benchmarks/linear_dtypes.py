"""The serving path's linear layers by dtype: float32 on the project's packed kernel, bfloat16 on
oneDNN's packed layout (`OneDnnProjection`), and bfloat16 through plain `F.linear`, at decode
and prefill row counts, on the products of the model shapes served (SmolLM2-135M's fused
gate_up and down, Qwen2.5-0.5B's gate_up, Llama-3.2-1B's gate_up and o).

Each case is timed as the best of 5 repeats of 30 calls, after 5 warm-up calls (the weights of
the small products fit in the last-level cache, so their GB/s at 1 row can exceed the memory's:
what matters there is the comparison in the same run). The report gives microseconds per call,
the bfloat16 weight bytes over that time (GB/s), and the ratio bfloat16 oneDNN ÷ float32 packed.

`--prefill ROWS` asks instead how close float32 gets to the machine's arithmetic at a prompt
step's row count: the serving path (`PackedProjection`), plain `F.linear` (MKL's sgemm on the
row-major weight) and oneDNN's float32 linear on its own packed layout, in GFLOP/s, on every
product of the three shapes.

    python benchmarks/linear_dtypes.py [--threads N] [--prefill 2048]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from paired import command_line, environment

from kvctl.agent.model.projection import OneDnnProjection, PackedProjection
from kvctl.agent.startup.wiring import default_torch_threads

SHAPES = (  # (name, out, in)
    ("135m gate_up", 3072, 576),
    ("135m down", 576, 1536),
    ("0.5b gate_up", 9728, 896),
    ("1b gate_up", 16384, 2048),
    ("1b o", 2048, 2048),
)
ROWS = (1, 8, 16, 64, 256)
PREFILL_SHAPES = (  # (name, out, in): every product of the 135M, 0.5B and 1B shapes
    ("135m qkv", 960, 576),
    ("135m o", 576, 576),
    ("135m gate_up", 3072, 576),
    ("135m down", 576, 1536),
    ("0.5b qkv", 1152, 896),
    ("0.5b gate_up", 9728, 896),
    ("0.5b down", 896, 4864),
    ("1b qkv", 3072, 2048),
    ("1b gate_up", 16384, 2048),
    ("1b down", 2048, 8192),
)


def best_us(call: Callable[[], object], calls: int = 30, repeats: int = 5) -> float:
    for _ in range(5):
        call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=default_torch_threads())
    parser.add_argument("--prefill", type=int, default=0, metavar="ROWS")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(command_line())
    print(environment())
    if args.prefill:
        return prefill(args.prefill)
    print("| product | rows | fp32 packed µs | bf16 oneDNN µs (GB/s) | bf16 F.linear µs | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for name, out, inp in SHAPES:
        weight = torch.randn(out, inp, generator=gen) * inp**-0.5
        fp32 = PackedProjection(weight)
        bf16 = OneDnnProjection(weight.bfloat16())
        dense = weight.bfloat16()
        for rows in ROWS:
            x = torch.randn(rows, inp, generator=gen)
            xb = x.bfloat16()
            a = best_us(functools.partial(fp32, x))
            b = best_us(functools.partial(bf16, xb))
            c = best_us(functools.partial(F.linear, xb, dense))
            gbs = out * inp * 2 / (b * 1e-6) / 1e9
            print(f"| {name} | {rows} | {a:.0f} | {b:.0f} ({gbs:.1f}) | {c:.0f} | {b / a:.2f}× |")
    return 0


def prefill(rows: int) -> int:
    """float32 GFLOP/s of three implementations at `rows` rows."""
    print("| product | serving path (packed) | F.linear (sgemm) | oneDNN float32 packed |")
    print("|---|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for name, out, inp in PREFILL_SHAPES:
        weight = torch.randn(out, inp, generator=gen) * inp**-0.5
        x = torch.randn(rows, inp, generator=gen)
        served = PackedProjection(weight)
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        calls = (
            functools.partial(served, x),
            functools.partial(F.linear, x, weight),
            functools.partial(torch.ops.mkldnn._linear_pointwise, x, onednn, None, "none", [], ""),
        )
        flops = 2 * rows * out * inp
        rates = [flops / (best_us(call, calls=3, repeats=3) * 1e3) for call in calls]
        print(f"| {name} {out} × {inp} | " + " | ".join(f"{r:.0f}" for r in rates) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
