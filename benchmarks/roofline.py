"""The memory roofline of a decode step: the bytes it must read over the bandwidth measured here.

A decode step reads every weight once and every running sequence's K/V once, and on a CPU (and,
at small batches, on a GPU) it can go no faster than memory delivers those bytes. Benchmarks
print their measured step beside this floor, so a figure says how far from the machine's limit
it is, not only how it compares with another program.
"""

from __future__ import annotations

import time

import torch

from kvctl.agent.model import ModelConfig


def read_bandwidth(device: torch.device, gib: float = 1.0, tries: int = 5) -> float:
    """Bytes/s of streaming a tensor much larger than the caches, best of `tries`: on a CPU
    read by `.sum()` (with torch's current thread count), on a GPU a device-to-device copy
    counting the bytes read and written (the bandwidth a kernel reading K/V sees)."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    nbytes = x.numel() * x.element_size()
    if device.type == "cuda":
        out = torch.empty_like(x)

        def op() -> None:
            out.copy_(x)

        nbytes *= 2
    else:

        def op() -> None:
            x.sum()

    op()
    best = float("inf")
    for _ in range(tries):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        op()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the weights a step reads (tied embeddings once: the output head reads them)."""
    hidden, heads, kv_heads, head_dim = (
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
    )
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    layer = attention + 3 * hidden * config.intermediate_size + 2 * hidden
    head = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    return (config.num_layers * layer + head + hidden) * dtype.itemsize


def kv_bytes(config: ModelConfig, batch: int, context: int, dtype: torch.dtype) -> int:
    """Bytes of K and V that `batch` sequences of `context` tokens hold (all layers)."""
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * dtype.itemsize
    return batch * context * per_token


def roofline_line(
    config: ModelConfig,
    batch: int,
    context: int,
    dtype: torch.dtype,
    bandwidth: float,
    step_s: float,
) -> str:
    """One line: bytes per step, the roofline step time and tok/s, and `step_s` against it."""
    nbytes = weight_bytes(config, dtype) + kv_bytes(config, batch, context, dtype)
    floor = nbytes / bandwidth
    return (
        f"roofline: a step reads {nbytes / 1e6:,.0f} MB (weights "
        f"{weight_bytes(config, dtype) / 1e6:,.0f} MB + KV of {batch} x {context} tokens) at "
        f"{bandwidth / 1e9:.1f} GB/s measured = {floor * 1e3:.2f} ms ({batch / floor:,.0f} tok/s); "
        f"measured step {step_s * 1e3:.2f} ms = {step_s / floor:.2f}x the roofline"
    )
