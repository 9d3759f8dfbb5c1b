"""Mixture-of-experts feed-forward (Mixtral, Qwen3-MoE, gpt-oss): a router picks `top_k`
experts per token, each expert is a SwiGLU MLP, and a token's output is its experts' outputs
weighted by the router's probabilities.

A step computes the experts grouped by expert, as vLLM's fused MoE does: the (token, expert)
pairs are sorted by expert once, and each expert that any token chose multiplies all of its rows
in one product. The Python loop runs over the experts a step uses, never over tokens. In the
serving form (`FusedMoE`) each expert's gate and up are one packed product and its down another,
packed once at load like the dense layers.

The routing is transformers': softmax over the router's logits in float32, the top k, those
renormalised to sum to 1 where the family does (Mixtral always, Qwen3-MoE with
`norm_topk_prob`), then the weights in the hidden states' dtype. gpt-oss differs in three ways
(`StackedMoE`): its router has a bias and takes the softmax over the chosen experts' logits
only, in their dtype; its experts have biases and a clamped SwiGLU, (up + 1) · gate ·
sigmoid(1.702 gate) with gate ≤ 7 and |up| ≤ 7 (`clamped_swiglu`); and the checkpoint stores
them stacked, [experts, in, out], with gate and up interleaved column by column.
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
    logits: Tensor, top_k: int, renormalize: bool, dtype: torch.dtype, after_top_k: bool = False
) -> tuple[Tensor, Tensor]:
    """(weights [T, k] in `dtype`, experts [T, k]) from router logits [T, experts];
    `after_top_k`: the softmax over the k largest logits, in their dtype (gpt-oss)."""
    if after_top_k:
        top, chosen = torch.topk(logits, top_k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype).to(dtype), chosen
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


def clamped_swiglu(gate: Tensor, up: Tensor, limit: float, alpha: float) -> Tensor:
    """gpt-oss's expert activation, as transformers computes it."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class StackedMoE(nn.Module):
    """gpt-oss's reference form, with its checkpoint's names: `mlp.router` (weight and bias) and
    `mlp.experts.{gate_up_proj,down_proj}` stacked over the experts, with their biases."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.renormalize = config.experts_per_token, True
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha
        hidden, inner, count = config.hidden_size, config.moe_intermediate_size, config.num_experts
        self.router = nn.Linear(hidden, count, bias=True)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(count, hidden, 2 * inner))
        self.experts.gate_up_proj_bias = nn.Parameter(torch.zeros(count, 2 * inner))
        self.experts.down_proj = nn.Parameter(torch.zeros(count, inner, hidden))
        self.experts.down_proj_bias = nn.Parameter(torch.zeros(count, hidden))

    def forward(self, x: Tensor) -> Tensor:
        weights, chosen = route(self.router(x), self.top_k, True, x.dtype, after_top_k=True)
        count = self.router.out_features
        return mix_experts(x, weights, chosen, [partial(self._expert, e) for e in range(count)])

    def _expert(self, e: int, rows: Tensor) -> Tensor:
        experts: Any = self.experts
        gate_up = rows @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
        act = clamped_swiglu(gate_up[..., ::2], gate_up[..., 1::2], self.limit, self.alpha)
        return act @ experts.down_proj[e] + experts.down_proj_bias[e]

    def stacked(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(gate_up [E, 2I, H] with the gates' rows first, its bias, down [E, H, I], its bias):
        the products in the [out, in] layout of a linear layer."""
        experts: Any = self.experts
        gate_up = experts.gate_up_proj.transpose(1, 2)
        gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
        bias = experts.gate_up_proj_bias
        bias = torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1)
        return gate_up, bias, experts.down_proj.transpose(1, 2), experts.down_proj_bias


class FusedMoE(nn.Module):
    """The serving form: the router and each expert's gate_up and down as packed products."""

    def __init__(self, moe: SparseMoE | StackedMoE, kernels: bool = True, down_scale: float = 1.0):
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.clamp: tuple[float, float] | None = None  # gpt-oss's (limit, alpha)
        of = partial(Projection.of, kernels=kernels)
        if isinstance(moe, StackedMoE):
            self.clamp = (moe.limit, moe.alpha)
            self.router = of(moe.router.weight, moe.router.bias)
            gate_up, up_bias, down, down_bias = moe.stacked()
            self.gate_up = nn.ModuleList(
                of(w.contiguous(), b) for w, b in zip(gate_up, up_bias, strict=True)
            )
            self.down = nn.ModuleList(
                of(scaled(w, down_scale).contiguous(), scaled(b, down_scale))
                for w, b in zip(down, down_bias, strict=True)
            )
            return
        self.router = of(moe.gate.weight)
        experts: list[Any] = list(moe.experts)
        self.gate_up = nn.ModuleList(
            of(torch.cat([e.gate_proj.weight, e.up_proj.weight])) for e in experts
        )
        self.down = nn.ModuleList(of(scaled(e.down_proj.weight, down_scale)) for e in experts)

    def forward(self, x: Tensor, silu_and_mul: Callable[[Tensor], Tensor]) -> Tensor:
        after_top_k = self.clamp is not None
        logits = self.router(x)
        weights, chosen = route(logits, self.top_k, self.renormalize, x.dtype, after_top_k)
        act = silu_and_mul if self.clamp is None else partial(_clamped_halves, *self.clamp)
        experts = [
            partial(_expert, gate_up, down, act)
            for gate_up, down in zip(self.gate_up, self.down, strict=True)
        ]
        return mix_experts(x, weights, chosen, experts)


def _clamped_halves(limit: float, alpha: float, gate_up: Tensor) -> Tensor:
    """`clamped_swiglu` of a [gate | up] product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return clamped_swiglu(gate, up, limit, alpha)


def _expert(
    gate_up: nn.Module, down: nn.Module, act_and_mul: Callable[[Tensor], Tensor], rows: Tensor
) -> Tensor:
    """One expert of `FusedMoE`: down(act(gate) · up) through its packed products."""
    return down(act_and_mul(gate_up(rows)))
