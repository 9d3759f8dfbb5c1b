"""KV bytes one request holds on a Gemma-3-1B-shaped model, with its sliding-window layers'
pages given back as the window moves on (`--window-pages release`, the default) and with every
layer keeping every page (`keep`), at 2K and 8K tokens of context.

The model has Gemma-3-1B's KV shape (26 layers, every 6th full attention and the others a
512-token window, 1 KV head of 256, float32 pages) and a small hidden size and vocabulary: KV
bytes depend only on the KV shape, and the small rest keeps an 8K-token prompt to seconds. One
request at a time, prompt = context - 16 tokens, 16 tokens generated; after every step the
request's pages (every page table of it) are counted. `admission` is what its admission takes
(its whole prompt has pages in every group until the step that computes it gives the window's
back), `end` what it holds at its last step (the steady state of a long decode).

vLLM's hybrid KV cache manager cuts the same model the same way (groups of 4 layers, one full
group and six sliding ones, a block table per group, sliding blocks freed once out of the
window): `vllm design` is that rule computed for the same page size, not a measurement.

    python benchmarks/window_pages.py [--contexts 2048,8192] [--page-size 16]

`--step-time DIR` times decode steps instead, on a checkpoint (Gemma-3-1B's whole shape from
`benchmarks/shape_checkpoints.py`): 8 requests of 512-token prompts decoding together, the
engine at its defaults but for the pages (release against keep), rounds paired and alternated,
the median step of 32 after the prompts. What giving pages back costs a step: a page table per
group to read, front pages to release.

    python benchmarks/window_pages.py --step-time ~/.cache/kvctl-bench/gemma-3-1b [--rounds 3]
        [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from paired import command_line, environment

from kvctl.agent.model import SamplingParams, load_checkpoint
from kvctl.agent.runtime import Engine, EngineConfig
from kvctl.agent.runtime.layer_groups import page_groups
from kvctl.settings import DefragSettings
from kvctl.units import format_bytes

NEW = 16


def gemma3_kv_shaped(directory: Path) -> Path:
    """A random-weight checkpoint with Gemma-3-1B's KV shape and a small rest."""
    import transformers

    config = transformers.Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        vocab_size=512,
        max_position_embeddings=32768,
        sliding_window=512,
        layer_types=[
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)
        ],
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(directory)
    return directory


def held_bytes(path: Path, release: bool, context: int, page_size: int) -> tuple[int, int]:
    """(admission, end) bytes of the request's pages."""
    _, model, tokenizer = load_checkpoint(path, "cpu", torch.float32)
    engine = Engine(
        model,
        tokenizer,
        EngineConfig(
            page_size=page_size,
            pool_pages=8 * (context // page_size + 1),
            segment_pages=64,
            defrag=DefragSettings(enabled=False),
            prefix_cache=False,
            release_window_pages=release,
        ),
    )
    prompt = torch.randint(3, 512, (context - NEW,), generator=torch.Generator().manual_seed(1))
    request = engine.add_request(
        prompt.tolist(), SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    )
    pages = engine.scheduler.pages
    admission = pages.pages_for(len(request.prompt_ids))
    end = 0
    while engine.has_work():
        engine.step()
        if pages.holds(request.seq_id):
            end = sum(len(t.pages) for t in pages.tables(request.seq_id))
    return admission * engine.pool.bytes_per_page, end * engine.pool.bytes_per_page


def vllm_design(path: Path, context: int, page_size: int) -> int:
    """Bytes vLLM's hybrid manager holds for the request at its last step: full groups a block
    per `page_size` tokens, sliding groups the blocks of the window and the next token."""
    mc, _, _ = load_checkpoint(path, "cpu", torch.float32)
    groups = page_groups(mc)
    block = 2 * page_size * mc.num_kv_heads * mc.head_dim * 4 * groups.size
    tokens = context - 1  # slots at the last step
    full = -(-tokens // page_size)
    blocks = 0
    for window in groups.windows:
        if window is None:
            blocks += full
        else:
            first = max(0, tokens - window) // page_size
            blocks += full - first
    return blocks * block


def step_ms(path: Path, release: bool, dtype: torch.dtype, batch: int = 8) -> float:
    """The median decode step (ms) of `batch` requests of 512-token prompts."""
    _, model, tokenizer = load_checkpoint(path, "cpu", dtype)
    engine = Engine(model, tokenizer, EngineConfig(pool_pages=4096, release_window_pages=release))
    gen = torch.Generator().manual_seed(2)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(3, 30000, (512,), generator=gen).tolist(), params)
    while any(r.num_computed < len(r.prompt_ids) for r in engine.requests.values()):
        engine.step()
    times = []
    for _ in range(32):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def step_times(path: Path, rounds: int, dtype: torch.dtype) -> None:
    ratios = []
    for i in range(rounds):
        order = (True, False) if i % 2 == 0 else (False, True)
        ms = {release: step_ms(path, release, dtype) for release in order}
        ratios.append(ms[True] / ms[False])
        print(f"round {i}: release {ms[True]:.1f} ms, keep {ms[False]:.1f} ms", flush=True)
    middle, low, high = statistics.median(ratios), min(ratios), max(ratios)
    print(f"release ÷ keep: median {middle:.3f} ({low:.3f}-{high:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--step-time", type=Path, default=None, help="checkpoint directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    print(command_line())
    print(environment())
    if args.step_time is not None:
        step_times(args.step_time.expanduser(), args.rounds, getattr(torch, args.dtype))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = gemma3_kv_shaped(Path(tmp))
        print("| context | keep: admission, end | release: admission, end | end ÷ keep's |", end="")
        print(" vLLM's rule |")
        print("|---|---|---|---|---|")
        for context in (int(c) for c in args.contexts.split(",")):
            keep = held_bytes(path, False, context, args.page_size)
            release = held_bytes(path, True, context, args.page_size)
            design = vllm_design(path, context, args.page_size)
            print(
                f"| {context:,} | {format_bytes(keep[0])}, {format_bytes(keep[1])} | "
                f"{format_bytes(release[0])}, {format_bytes(release[1])} | "
                f"{release[1] / keep[1]:.2f} | {format_bytes(design)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
