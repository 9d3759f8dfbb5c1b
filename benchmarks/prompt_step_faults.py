"""A prompt step's time and page faults on the engine's own thread, under the agent's malloc
settings (`configure_malloc`: a 64 MiB mmap threshold and a 128 MiB trim threshold) against the
mmap threshold alone (glibc's trim threshold then stays at 128 KiB).

The agent loads the model on its main thread and runs the engine on a thread of its own, so its
activations come from a malloc arena of that thread, fresh and holding nothing else; with a
128 KiB trim threshold the arena gives each freed activation back to the system, and the next
layer faults it in again. Both settings run in one process on one engine,
alternating round by round (the trim threshold is changed between rounds), each round a fresh
step of `--prompts` prompts of `--tokens` tokens after one step that warms the heap up; the
report gives each side's median step time with its spread, the page faults a step took, and
the per-round ratio.

    python benchmarks/prompt_step_faults.py [--model 135m] [--dtype bfloat16] [--prompts 8]
        [--tokens 256] [--rounds 7]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import resource
import statistics
import sys
import threading
import time
from functools import partial

import torch
from model_shapes import MODELS, benchmark_model
from paired import MIN_ROUNDS, command_line, environment, load_average, paired_rounds, spread

from kvctl.agent.memory import M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES, configure_malloc
from kvctl.agent.model import LlamaModel, ModelConfig
from kvctl.agent.model.sampling import SamplingParams
from kvctl.agent.runtime import Engine, EngineConfig

GLIBC_TRIM_THRESHOLD = 128 << 10


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Steps:
    """One engine; `step(trim_threshold)` times a fresh prompt step under that threshold."""

    def __init__(self, args: argparse.Namespace, config: ModelConfig, model: LlamaModel) -> None:
        self.engine = Engine(model, None, EngineConfig(device="cpu", pool_pages=8192))
        self.vocab, self.args, self.round = config.vocab_size, args, 0
        self.faults: dict[int, list[int]] = {}
        self.libc = ctypes.CDLL(ctypes.util.find_library("c"))

    def _prompts(self) -> None:
        gen = torch.Generator().manual_seed(self.round)
        self.round += 1
        params = SamplingParams(max_tokens=1)
        for _ in range(self.args.prompts):
            ids = torch.randint(3, self.vocab, (self.args.tokens,), generator=gen).tolist()
            self.engine.add_request(ids, params)

    def step(self, trim_threshold: int) -> float:
        self.libc.mallopt(M_TRIM_THRESHOLD, trim_threshold)
        self.libc.malloc_trim(0)  # both sides start from a trimmed heap
        for _ in range(2):  # the first step after the trim pays its faults on both sides
            self._prompts()
            before, started = minor_faults(), time.perf_counter()
            self.engine.step()
            seconds, faults = time.perf_counter() - started, minor_faults() - before
            while self.engine.has_work():
                self.engine.step()
        self.faults.setdefault(trim_threshold, []).append(faults)
        return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="135m")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}")
    if not configure_malloc():
        print("# not glibc: the malloc settings do not apply here", file=sys.stderr)
        return 2
    print(command_line())
    print(environment())
    results: list = []

    config, model, _ = benchmark_model(args.model)  # built on the main thread, as the agent does
    model.to(getattr(torch, args.dtype))

    def run() -> None:
        steps = Steps(args, config, model)
        agent = partial(steps.step, TRIM_THRESHOLD_BYTES)
        mmap_only = partial(steps.step, GLIBC_TRIM_THRESHOLD)
        results.append((paired_rounds(agent, mmap_only, args.rounds), steps.faults))

    thread = threading.Thread(target=run)  # the engine's own thread, as in the agent
    thread.start()
    thread.join()
    paired, faults = results[0]
    print(
        f"# {args.prompts} prompts of {args.tokens} tokens, {args.model} shape, {args.dtype}, "
        f"one step each, {args.rounds} alternating rounds"
    )
    print(
        f"agent's malloc settings: {spread(paired.ours, 1000, '.0f')} ms a step, "
        f"{statistics.median(faults[TRIM_THRESHOLD_BYTES]):,.0f} page faults"
    )
    print(
        f"mmap threshold alone:   {spread(paired.base, 1000, '.0f')} ms a step, "
        f"{statistics.median(faults[GLIBC_TRIM_THRESHOLD]):,.0f} page faults"
    )
    print(f"agent ÷ mmap threshold alone: {paired.ratio_summary()}")
    print(load_average())
    return 0


if __name__ == "__main__":
    sys.exit(main())
