"""Mixture-of-experts feed-forward (Mixtral, Qwen3-MoE): a router picks `top_k` experts per
token, each expert is a SwiGLU MLP, and a token's output is its experts' outputs weighted by the
router's probabilities.

A step computes the experts grouped by expert, as vLLM's fused MoE does: the (token, expert)
pairs are sorted by expert once, and each expert that any token chose multiplies all of its rows
in one product. The Python loop runs over the experts a step uses, never over tokens. In the
serving form (`FusedMoE`) each expert's gate and up are one packed product and its down another,
packed once at load like the dense layers.

The routing is transformers': softmax over the router's logits in float32, the top k, those
renormalised to sum to 1 where the family does (Mixtral always, Qwen3-MoE with
`norm_topk_prob`), then the weights in the hidden states' dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvctl.agent.model.config import ModelConfig
from kvctl.agent.model.projection import Projection, scaled

Expert = Callable[[Tensor], Tensor]


def route(
    logits: Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(weights [T, k] in `dtype`, experts [T, k]) from router logits [T, experts]."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), chosen


def mix_experts(x: Tensor, weights: Tensor, chosen: Tensor, experts: Sequence[Expert]) -> Tensor:
    """Σ over each token's chosen experts of weight × expert(token), computed expert by expert:
    x [T, hidden], weights and chosen [T, k] -> [T, hidden]."""
    top_k = chosen.shape[1]
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    tokens = order // top_k  # the token of each (token, expert) pair, grouped by expert
    pair_weights = weights.flatten()[order].unsqueeze(1)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in zip(experts, counts, strict=True):
        if not count:
            continue
        rows = tokens[start : start + count]
        y = expert(x.index_select(0, rows)) * pair_weights[start : start + count]
        out.index_add_(0, rows, y)
        start += count
    return out


class SparseMoE(nn.Module):
    """The reference form, with the checkpoint's module names (`mlp.gate`, `mlp.experts.{e}`)."""

    def __init__(self, config: ModelConfig, experts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.top_k, self.renormalize = config.experts_per_token, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(experts)

    def forward(self, x: Tensor) -> Tensor:
        weights, chosen = route(self.gate(x), self.top_k, self.renormalize, x.dtype)
        return mix_experts(x, weights, chosen, list(self.experts))


class FusedMoE(nn.Module):
    """The serving form: the router and each expert's gate_up and down as packed products."""

    def __init__(self, moe: SparseMoE, kernels: bool = True, down_scale: float = 1.0) -> None:
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.router = Projection.of(moe.gate.weight, kernels=kernels)
        experts: list[Any] = list(moe.experts)
        self.gate_up = nn.ModuleList(
            Projection.of(torch.cat([e.gate_proj.weight, e.up_proj.weight]), kernels=kernels)
            for e in experts
        )
        self.down = nn.ModuleList(
            Projection.of(scaled(e.down_proj.weight, down_scale), kernels=kernels) for e in experts
        )

    def forward(self, x: Tensor, silu_and_mul: Callable[[Tensor], Tensor]) -> Tensor:
        weights, chosen = route(self.router(x), self.top_k, self.renormalize, x.dtype)
        experts = [
            partial(_expert, gate_up, down, silu_and_mul)
            for gate_up, down in zip(self.gate_up, self.down, strict=True)
        ]
        return mix_experts(x, weights, chosen, experts)


def _expert(
    gate_up: nn.Module, down: nn.Module, silu_and_mul: Callable[[Tensor], Tensor], rows: Tensor
) -> Tensor:
    """One expert of `FusedMoE`: down(silu(gate) · up) through its packed products."""
    return down(silu_and_mul(gate_up(rows)))
