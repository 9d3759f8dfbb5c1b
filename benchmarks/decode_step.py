"""Decode step time on the paged pool vs a contiguous per-sequence KV cache, and against the
memory roofline.

Both sides run the same model on the same batch (8 sequences, 512 tokens of context each):
prefill once, then time decode steps, each adding one token to every sequence. The contiguous
side is `ContiguousKVCache` (one preallocated region per sequence, written in place); the paged
side is what the engine does per step: reserve the token's slot in the pool, build the page
index, write K/V into pages and read them back by page table (`PagedKVCache` picks the read
path). Sampling is left out of both (it is the same code).

Rounds are paired and interleaved (paged, contiguous, contiguous, paged, ...): each round prefills
both sides afresh and times `--steps` decode steps of each, and the figure is the per-round ratio
of their median step times, so drift on a shared machine cancels within a round. The report gives
the median ratio with its min and max, both sides' absolute ms/step and tokens/s, the torch thread
count and the load average.

Both sides run the model in its serving form (`fused.fuse`: fused products, the CPU kernels
where they run), as the engine does. The report ends with the roofline: the bytes a step must
read (weights and the batch's K/V, `roofline.py`) over the bandwidth measured in the same run,
and the paged step as a multiple of that floor.

`--model 135m` runs SmolLM-135M's shape and `--model llama-1b` Llama 3.2 1B shapes (16 layers,
32 query and 8 KV heads of 64, hidden 2048, vocab 128256), both with random weights; `--dtype`
sets the weight and KV dtype (default float32, bfloat16 for llama-1b). `--threads` sets torch's
CPU thread count (default: torch's own); `--read-path` how paged decode reads K/V
(`PagedKVCache`: auto, paged, gather or flex).

    python benchmarks/decode_step.py [--device cpu] [--model demo|135m|llama-1b] [--batch 8]
        [--context 512] [--steps 32] [--rounds 9] [--threads N] [--read-path auto]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from model_shapes import smollm_135m_shape
from paired import MIN_ROUNDS, command_line, environment, paired_rounds, spread
from roofline import read_bandwidth, roofline_line

from kvctl.agent.model import (
    BatchLayout,
    ContiguousKVCache,
    LlamaModel,
    ModelConfig,
    build_demo_model,
)
from kvctl.agent.model.fused import fuse
from kvctl.agent.pool import PagePool
from kvctl.agent.pool.storage import KVStorage
from kvctl.agent.runtime.paged_cache import PagedKVCache, ReadPath

WARMUP_STEPS = 2
"""Decode steps of each round left out of its median (first-touch of buffers, allocator)."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def contiguous_steps(model: LlamaModel, prompts: torch.Tensor, steps: int) -> list[float]:
    """Seconds of each decode step on `ContiguousKVCache`, after one prefill."""
    batch, context = prompts.shape
    device = prompts.device
    cache = ContiguousKVCache(
        model.config, batch, context + steps + 1, device=device, dtype=prompts_dtype(model)
    )
    seqs = list(range(batch))
    layout = cache.begin_step(seqs, [context] * batch)
    hidden = model(prompts.reshape(-1), layout.positions(device), cache)
    last = model.logits(hidden[layout.last_token_indices(device)]).argmax(-1)
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        layout = cache.begin_step(seqs, [1] * batch)
        last = model.logits(model(last, layout.positions(device), cache)).argmax(-1)
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def paged_steps(
    model: LlamaModel,
    prompts: torch.Tensor,
    steps: int,
    page_size: int,
    read_path: ReadPath = "auto",
) -> list[float]:
    """Seconds of each decode step on the page pool (pool bookkeeping included), after a prefill."""
    batch, context = prompts.shape
    device = prompts.device
    config = model.config
    pages = batch * (-(-(context + steps + 1) // page_size)) + 64
    storage = KVStorage(
        1,
        pages,
        page_size,
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
        prompts_dtype(model),
        device,
    )
    pool = PagePool(pages, page_size, bytes_per_page=storage.bytes_per_page)
    cache = PagedKVCache(pool, storage, read_path, num_heads=config.num_heads)
    seqs = list(range(batch))
    for s in seqs:
        pool.allocate(s, context)
    layout = BatchLayout(tuple(seqs), (0,) * batch, (context,) * batch)
    cache.begin_step(layout)
    hidden = model(prompts.reshape(-1), layout.positions(device), cache)
    last = model.logits(hidden[layout.last_token_indices(device)]).argmax(-1)
    length = context
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        for s in seqs:
            pool.append(s, 1)
        layout = BatchLayout(tuple(seqs), (length,) * batch, (1,) * batch)
        cache.begin_step(layout)
        last = model.logits(model(last, layout.positions(device), cache)).argmax(-1)
        sync(device)
        times.append(time.perf_counter() - start)
        length += 1
    return times


def prompts_dtype(model: LlamaModel) -> torch.dtype:
    return next(model.parameters()).dtype


LLAMA_1B = ModelConfig(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    name="llama-1b-shapes",
)


def build_model(name: str, device: torch.device, dtype: torch.dtype | None) -> LlamaModel:
    """The demo model, SmolLM-135M's or Llama 3.2 1B's shapes with random weights, fused."""
    return fuse(_unfused(name, device, dtype))


def _unfused(name: str, device: torch.device, dtype: torch.dtype | None) -> LlamaModel:
    if name in ("demo", "135m"):
        config = smollm_135m_shape() if name == "135m" else None
        return build_demo_model(device, dtype or torch.float32, config=config)[1]
    with torch.device(device):
        model = LlamaModel(LLAMA_1B).to(dtype or torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(0)
    for pname, param in model.named_parameters():
        if not pname.endswith("norm.weight"):
            param.data.normal_(0.0, 0.02, generator=generator)
    return model.eval().requires_grad_(False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", choices=("demo", "135m", "llama-1b"), default="demo")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--read-path",
        choices=("auto", "paged", "gather", "flex"),
        default="auto",
        help="how paged decode reads K/V (auto: flex on CUDA, paged where the CPU kernels run)",
    )
    args = parser.parse_args(argv)
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}: fewer pairs say little")
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than {WARMUP_STEPS}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(command_line())
    device = torch.device(args.device)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = build_model(args.model, device, dtype)
    vocab = min(model.config.vocab_size, 256)
    prompts = torch.randint(0, vocab, (args.batch, args.context), device=device)

    def paged() -> float:
        return statistics.median(
            paged_steps(model, prompts, args.steps, args.page_size, args.read_path)[WARMUP_STEPS:]
        )

    def contiguous() -> float:
        return statistics.median(contiguous_steps(model, prompts, args.steps)[WARMUP_STEPS:])

    paged(), contiguous()  # warm-up: first-use allocations and lazy initialisation
    result = paired_rounds(paged, contiguous, args.rounds)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(environment())
    print(
        f"device {device} ({where}), model {args.model} {prompts_dtype(model)}, "
        f"batch {args.batch}, context {args.context}, page size {args.page_size}, "
        f"decode read path {args.read_path}, {args.steps - WARMUP_STEPS} timed steps per round"
    )
    tokens = args.batch
    for name, times in (("contiguous KV cache", result.base), ("paged KV pool", result.ours)):
        rates = [tokens / t for t in times]
        print(
            f"{name + ':':21s}{spread(times, 1e3)} ms/step  {spread(rates, 1, '.0f')} tokens/s"
            "  median (min-max) over rounds"
        )
    print(f"ratio paged/contiguous: {result.ratio_summary()}")
    print("per-round ratios: " + " ".join(f"{r:.2f}" for r in result.ratios))
    step = statistics.median(result.ours)
    bandwidth = read_bandwidth(device)
    print(
        roofline_line(model.config, args.batch, args.context, prompts_dtype(model), bandwidth, step)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
