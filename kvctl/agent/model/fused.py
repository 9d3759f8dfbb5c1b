"""The serving form of a loaded model: fewer, larger products and one pass per elementwise step,
made once at load.

A checkpoint loads into `LlamaModel` with Hugging Face's modules and names (`q_proj`, `k_proj`,
`v_proj`, `gate_proj`, `up_proj`), so loading, state dicts and the tests against transformers
stay exact. Serving wants the opposite: on a decode step every product is a pass over its
weight and every operation a fixed cost (at 8 rows, dispatching a small torch operation costs
more than its arithmetic). `fuse(model)` therefore rewrites the model in place, once:

- each attention's three projections become one `qkv` product and each MLP's gate and up one
  `gate_up` product, every product (the output head too) a `Projection` in the layout the
  device reads best (`projection.py`);
- the decoder runs each layer as norm → qkv → rotary (in place on q and k) → attention → o →
  residual add + norm → gate_up → silu(gate) · up → down, with the residual add of one block
  folded into the norm that opens the next (`LayerOps`: the CPU kernels' single passes where
  they run, the same steps in torch elsewhere).

The math is the model's: the same weights and the same operations per element, in float32 for
the norms as Hugging Face computes them; only the order of a few floating-point sums differs
(logits within 1e-4 of the unfused model, as tests hold it, the tolerance every comparison
with transformers uses). A fused model still runs through
`LlamaModel.forward` and `logits`; its state dict is no longer Hugging Face's, so load and
compare before fusing.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvctl.agent.kernels import cpu_ops
from kvctl.agent.model.attention import AttentionBackend
from kvctl.agent.model.llama import (
    Decoder,
    DecoderLayer,
    LlamaModel,
    RMSNorm,
    embed,
    folded_norm,
    rotations,
)
from kvctl.agent.model.moe import FusedMoE, SparseMoE, StackedMoE
from kvctl.agent.model.projection import Projection, scaled
from kvctl.agent.model.rope import apply_rotary


class LayerOps:
    """The elementwise steps of a layer in torch: the reference, and the path everywhere the
    CPU kernels do not run (a GPU, float16, a CPU without them)."""

    name = "torch"

    def rms_norm(self, x: Tensor, norm: RMSNorm) -> Tensor:
        return norm(x)

    def add_rms_norm_(self, residual: Tensor, x: Tensor, norm: RMSNorm) -> Tensor:
        """residual += x in place; returns norm(residual)."""
        residual.add_(x)
        return norm(residual)

    def rotary(
        self, qkv: Tensor, cos: Tensor, sin: Tensor, split: tuple[int, int, int], head_dim: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q, k (rotated) and v of a qkv product [T, q + k + v], each [T, heads, head_dim]."""
        t = qkv.shape[0]
        q, k, v = qkv.split(split, dim=-1)
        q = apply_rotary(q.view(t, -1, head_dim), cos, sin)
        k = apply_rotary(k.view(t, -1, head_dim), cos, sin)
        return q, k, v.view(t, -1, head_dim)

    def silu_and_mul(self, gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_and_mul(self, gate_up: Tensor) -> Tensor:
        """Gemma's GeGLU: gelu_tanh(gate) · up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class KernelLayerOps(LayerOps):
    """The same steps as single passes of the CPU kernels (float32 or bfloat16 on a CPU; in
    bfloat16 each step computes in float32 and rounds where Hugging Face's modules round: a
    norm with a float32 weight, Gemma's folded (1 + w), as Gemma's norm rounds)."""

    name = "cpu-kernels"

    def __init__(self, ops: ModuleType) -> None:
        self._ops = ops

    def rms_norm(self, x: Tensor, norm: RMSNorm) -> Tensor:
        return self._ops.rms_norm(x, norm.weight, norm.eps)

    def add_rms_norm_(self, residual: Tensor, x: Tensor, norm: RMSNorm) -> Tensor:
        return self._ops.add_rms_norm_(residual, x.contiguous(), norm.weight, norm.eps)

    def rotary(
        self, qkv: Tensor, cos: Tensor, sin: Tensor, split: tuple[int, int, int], head_dim: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        t = qkv.shape[0]
        q_dim, k_dim, _ = split
        self._ops.rotary_(qkv, cos, sin, (q_dim + k_dim) // head_dim, head_dim)
        q, k, v = qkv.split(split, dim=-1)
        return q.view(t, -1, head_dim), k.view(t, -1, head_dim), v.view(t, -1, head_dim)

    def silu_and_mul(self, gate_up: Tensor) -> Tensor:
        return self._ops.silu_and_mul(gate_up)

    def gelu_and_mul(self, gate_up: Tensor) -> Tensor:
        return self._ops.gelu_tanh_and_mul(gate_up)


def layer_ops_for(weight: Tensor, kernels: bool = True) -> LayerOps:
    """The kernels' single passes for float32 or bfloat16 weights on a CPU where they run (and
    `kernels`), else torch."""
    ops = cpu_ops() if kernels and weight.device.type == "cpu" else None
    if ops is not None and weight.dtype in (torch.float32, torch.bfloat16):
        return KernelLayerOps(ops)
    return LayerOps()


class FusedLayer(nn.Module):
    """One decoder layer with fused products; its norms and residual adds run in the decoder.

    The families' scalar factors are folded into the weights here, once: Granite's and Gemma's
    query scale into q's rows (or, after a q norm, into that norm's weight), Granite's residual
    multiplier into o and down, and Gemma's (1 + w) into its norms' weights, so the step pays
    nothing for them."""

    def __init__(self, layer: DecoderLayer, kernels: bool = True) -> None:
        super().__init__()
        attention, mlp = layer.self_attn, layer.mlp
        self.layer_index = attention.layer_index
        self.head_dim = attention.head_dim
        q_dim = attention.num_heads * attention.head_dim
        kv_dim = attention.num_kv_heads * attention.head_dim
        self.split = (q_dim, kv_dim, kv_dim)
        self.qk_norm = attention.qk_norm
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        self.local_rope = layer.local_rope
        self.sinks = attention.sinks
        scale, m = attention.query_scale, layer.residual_multiplier
        parts = (attention.q_proj, attention.k_proj, attention.v_proj)
        weights: list[Tensor] = [p.weight for p in parts]
        biases: list[Tensor] | None = None if parts[0].bias is None else [p.bias for p in parts]
        if self.qk_norm is not None:
            self.q_norm = folded_norm(attention.q_norm, scale)
            self.k_norm = folded_norm(attention.k_norm)
        else:
            weights[0] = scaled(weights[0], scale)
            if biases is not None:
                biases[0] = scaled(biases[0], scale)
        bias = None if biases is None else torch.cat(biases)
        self.qkv = Projection.of(torch.cat(weights), bias, kernels)
        o_bias = attention.o_proj.bias
        self.o = Projection.of(
            scaled(attention.o_proj.weight, m),
            None if o_bias is None else scaled(o_bias, m),
            kernels,
        )
        self.moe: FusedMoE | None = None
        self.gelu = False
        if isinstance(mlp, SparseMoE | StackedMoE):
            self.moe = FusedMoE(mlp, kernels, down_scale=m)
        else:
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            self.gate_up = Projection.of(gate_up, kernels=kernels)
            self.down = Projection.of(scaled(mlp.down_proj.weight, m), kernels=kernels)
            self.gelu = mlp.gelu
        # the norms around each sublayer, None where the family has none: Llama's before each,
        # OLMo 2's after each, Gemma 2 and 3's on both sides
        post = layer.post_norms or layer.sandwich
        self.attn_in = None if layer.post_norms else folded_norm(layer.input_layernorm)
        self.attn_out = folded_norm(layer.post_attention_layernorm) if post else None
        self.mlp_in: RMSNorm | None = None
        if not layer.post_norms:
            before_mlp = layer.pre_feedforward_layernorm if layer.sandwich else None
            self.mlp_in = folded_norm(before_mlp or layer.post_attention_layernorm)
        self.mlp_out = folded_norm(layer.post_feedforward_layernorm) if post else None

    def attention(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        attention: AttentionBackend,
        ops: LayerOps,
    ) -> Tensor:
        qkv = self.qkv(h)
        if self.qk_norm is not None:
            self._norm_qk(qkv, ops)
        q, k, v = ops.rotary(qkv, cos, sin, self.split, self.head_dim)
        out = attention.attend(self.layer_index, q, k, v)  # [T, h, d]
        return self.o(out.reshape(h.shape[0], -1))

    def _norm_qk(self, qkv: Tensor, ops: LayerOps) -> None:
        """q and k of the qkv product normed in place, before the rotation: over each head
        (rows of head_dim) or over the whole projection."""
        assert self.q_norm is not None and self.k_norm is not None
        t, (q_dim, kv_dim, _) = qkv.shape[0], self.split
        width = self.head_dim if self.qk_norm == "head" else None
        for part, norm in (
            (qkv[:, :q_dim], self.q_norm),
            (qkv[:, q_dim : q_dim + kv_dim], self.k_norm),
        ):
            rows = part.reshape(-1, width or part.shape[1]).contiguous()  # the part is strided
            part.copy_(ops.rms_norm(rows, norm).view(t, -1))

    def mlp(self, h: Tensor, ops: LayerOps) -> Tensor:
        if self.moe is not None:
            return self.moe(h, ops.silu_and_mul)
        act = ops.gelu_and_mul if self.gelu else ops.silu_and_mul
        return self.down(act(self.gate_up(h)))


class FusedDecoder(nn.Module):
    """`Decoder` over fused layers: x = embed; per layer x += attn(h) and x += mlp(h), h being
    x or its norm, each sublayer's output normed where the family norms it (OLMo 2, Gemma 2/3);
    then the final norm. Each residual add is fused into the norm that follows it."""

    def __init__(self, decoder: Decoder, kernels: bool = True) -> None:
        super().__init__()
        self.embed_tokens = decoder.embed_tokens
        self.embedding_multiplier = decoder.embedding_multiplier
        self.round_multiplier = decoder.round_multiplier
        self.rotary_emb = decoder.rotary_emb
        self.local_rotary_emb = decoder.local_rotary_emb
        self.norm = folded_norm(decoder.norm)
        self.blocks = [FusedLayer(layer, kernels) for layer in decoder.blocks]
        """The layers, typed (`nn.ModuleList` yields plain modules); `layers` registers them."""
        self.layers = nn.ModuleList(self.blocks)
        self.ops = layer_ops_for(decoder.embed_tokens.weight, kernels)

    def forward(self, token_ids: Tensor, positions: Tensor, attention: AttentionBackend) -> Tensor:
        x = embed(self, token_ids)  # [T, hidden], the residual stream (updated in place)
        ropes = rotations(self, positions, x.dtype)  # cos/sin [T, head_dim] per rope
        ops, blocks = self.ops, self.blocks
        first = blocks[0].attn_in
        h = x if first is None else ops.rms_norm(x, first)
        for i, layer in enumerate(blocks):
            out = layer.attention(h, *ropes[layer.local_rope], attention, ops)
            h = self._add(x, out, layer.attn_out, layer.mlp_in)
            after = blocks[i + 1].attn_in if i + 1 < len(blocks) else self.norm
            h = self._add(x, layer.mlp(h, ops), layer.mlp_out, after)
        return h

    def _add(
        self, x: Tensor, out: Tensor, out_norm: RMSNorm | None, next_norm: RMSNorm | None
    ) -> Tensor:
        """x += out (normed first where `out_norm`); the input of what follows: the norm of x
        where `next_norm`, else x itself."""
        if out_norm is not None:
            out = self.ops.rms_norm(out, out_norm)
        if next_norm is None:
            return x.add_(out)
        return self.ops.add_rms_norm_(x, out, next_norm)


def fuse(model: LlamaModel, kernels: bool = True) -> LlamaModel:
    """Rewrite `model` in place into its serving form (once: a fused model is left as it is).
    `kernels=False` keeps every step in torch even where the CPU kernels run."""
    decoder = model.model
    if model.head is not None or isinstance(decoder, FusedDecoder):
        return model
    with torch.no_grad():
        lm_head = model.lm_head
        weight = model.model.embed_tokens.weight if lm_head is None else lm_head.weight
        model.head = Projection.of(weight, kernels=kernels)
        model.lm_head = None
        model.model = FusedDecoder(decoder, kernels)
    return model


def uses_kernels(model: LlamaModel) -> bool:
    """Whether a fused model runs on the CPU kernels."""
    decoder = model.model
    return isinstance(decoder, FusedDecoder) and isinstance(decoder.ops, KernelLayerOps)
