"""Fixtures of the model-runtime tests: greedy generation through a KV cache."""

from collections.abc import Callable, Sequence

import pytest
import torch

from kvctl.agent.model import ContiguousKVCache, LlamaModel, ModelConfig

Generate = Callable[[LlamaModel, Sequence[Sequence[int]], int], list[list[int]]]


def greedy_generate(
    model: LlamaModel, prompts: Sequence[Sequence[int]], new_tokens: int
) -> list[list[int]]:
    """Greedy continuation of each prompt: all prompts prefilled as one flattened batch, then
    batched decode steps. The decode order rotates every step, so steps alternate between the
    consecutive-slot view and the gathered (index_select) path of the cache."""
    config: ModelConfig = model.config
    longest = max(len(p) for p in prompts) + new_tokens
    weight = next(model.parameters())
    device = weight.device
    cache = ContiguousKVCache(
        config,
        max_seqs=len(prompts) + 1,
        max_len=longest,
        device=device,
        dtype=weight.dtype,
        sinks=model.attention_sinks(),
    )
    seqs = list(range(len(prompts)))
    layout = cache.begin_step(seqs, [len(p) for p in prompts])
    tokens = torch.tensor([t for p in prompts for t in p], device=device)
    hidden = model(tokens, layout.positions(device), cache)
    next_ids = model.logits(hidden[layout.last_token_indices(device)]).argmax(-1)  # [B]
    out = {s: [int(t)] for s, t in zip(seqs, next_ids, strict=True)}
    for step in range(new_tokens - 1):
        order = seqs[step % len(seqs) :] + seqs[: step % len(seqs)]
        layout = cache.begin_step(order, [1] * len(order))
        last = torch.tensor([out[s][-1] for s in order], device=device)
        next_ids = model.logits(model(last, layout.positions(device), cache)).argmax(-1)
        for s, t in zip(order, next_ids, strict=True):
            out[s].append(int(t))
    return [out[s] for s in seqs]


@pytest.fixture
def generate() -> Generate:
    return greedy_generate
