"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, OLMo 2, Granite, Phi-3, Gemma 1, 2, 3,
and the Mixtral, Qwen3-MoE and gpt-oss mixtures of experts) over a flattened, variable-length
batch; the families' switches are `config.Family`. Which keys a layer's queries see (a sliding
window, soft-capped scores, sinks) is the attention backend's business (`LayerAttention`).

Tokens of all sequences of a step are concatenated into one [T] batch, as in vLLM and nano-vllm:
no padding, each token with its own position. The KV cache is not part of the model; every
attention layer reaches it through the `AttentionBackend` passed to `forward`, so the same model
runs on the contiguous baseline and on the paged pool.

Module and parameter names equal Hugging Face's (`model.layers.{i}.self_attn.q_proj.weight`, ...),
so a checkpoint's state dict loads by name. With tied embeddings there is no `lm_head` module: the
logits reuse `model.embed_tokens.weight`, just as tied checkpoints store no `lm_head.weight`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvctl.agent.model.attention import AttentionBackend
from kvctl.agent.model.config import ModelConfig
from kvctl.agent.model.moe import SparseMoE, StackedMoE
from kvctl.agent.model.rope import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:
    from kvctl.agent.model.fused import FusedDecoder


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, then scaled in the input dtype (as Llama does).

    `gemma`: scaled by (1 + weight) in float32 and rounded after (Gemma's norm, whose checkpoints
    store the offset from 1). `folded_norm` turns one into a norm with the whole scale as a
    float32 weight; a float32 weight on rows of a narrower dtype always scales in float32 and
    rounds once, the rule the CPU kernel applies too."""

    def __init__(self, dim: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: Tensor) -> Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.gemma:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        if self.weight.dtype == torch.float32:
            return (normed * self.weight).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def folded_norm(norm: RMSNorm, factor: float = 1.0) -> RMSNorm:
    """A norm computing `norm` times `factor` with its whole scale as its weight: Gemma's
    (1 + w) added once at load (a float32 weight), and a query scale folded in; `norm` itself
    when there is nothing to fold."""
    if not norm.gemma and factor == 1.0:
        return norm
    weight = norm.weight.detach().float()
    out = RMSNorm(weight.shape[0], norm.eps)
    scale = (1.0 + weight if norm.gemma else weight) * factor
    out.weight = nn.Parameter(scale if norm.gemma else scale.to(norm.weight.dtype), False)
    return out


class Embedding(nn.Module):
    """Token embedding table [vocab, hidden]. Unlike `nn.Embedding` it draws no random init:
    weights always come from a checkpoint or the demo initialiser, and a random `normal_` on the
    meta device would pull in torch's compiler stack (about a second of imports)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab_size, hidden_size))

    def forward(self, token_ids: Tensor) -> Tensor:
        return F.embedding(token_ids, self.weight)


class SelfAttention(nn.Module):
    """Grouped-query attention; K/V storage and the attention itself belong to the backend."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=config.o_proj_bias)
        self.qk_norm = config.family.qk_norm
        if self.qk_norm is not None:  # Qwen3, Gemma 3: over each head; OLMo 2: the projection
            per_head, eps, gemma = self.qk_norm == "head", config.rms_norm_eps, config.family.gemma
            self.q_norm = RMSNorm(config.head_dim if per_head else q_dim, eps, gemma)
            self.k_norm = RMSNorm(config.head_dim if per_head else kv_dim, eps, gemma)
        self.query_scale = config.query_scale
        self.sinks = nn.Parameter(torch.zeros(config.num_heads)) if config.attention_sinks else None
        """gpt-oss's sink logit per query head; the backend applies it (`LayerAttention`)."""

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend) -> Tensor:
        """x [T, hidden], cos/sin [T, head_dim] -> [T, hidden]."""
        t = x.shape[0]
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, h, d]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, kvh, d]
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, kvh, d]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.query_scale != 1.0:  # the backend scales by 1 / sqrt(head_dim)
            q = q * self.query_scale
        out = attention.attend(self.layer_index, q, k, v)  # [T, h, d]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); GeGLU for Gemma: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inner = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.down_proj = nn.Linear(inner, config.hidden_size, bias=False)
        self.gelu = config.family.gemma

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate_proj(x)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)) (Gemma 1's too, with
    its (1 + w) norms); with post norms (OLMo 2) x + norm(attn(x)), then x + norm(mlp(x));
    Gemma 2 and 3's both, x + norm(attn(norm(x))), then x + norm(mlp(norm(x))). Granite scales
    each branch by its residual multiplier."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        hidden, eps, gemma = config.hidden_size, config.rms_norm_eps, config.family.gemma
        self.post_norms = config.family.post_norms
        self.sandwich = config.family.sandwich
        self.local_rope = config.local_rope(layer_index)
        if not self.post_norms:
            self.input_layernorm = RMSNorm(hidden, eps, gemma)
        self.self_attn = SelfAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(hidden, eps, gemma)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, gemma)
        if self.post_norms or self.sandwich:
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, gemma)
        self.mlp: MLP | SparseMoE | StackedMoE
        if config.family.experts == "gpt_oss":
            self.mlp = StackedMoE(config)
        elif config.is_moe_layer(layer_index):
            inner = config.moe_intermediate_size
            experts = [MLP(config, inner) for _ in range(config.num_experts)]
            self.mlp = SparseMoE(config, experts)
        else:
            self.mlp = MLP(config)
        self.residual_multiplier = config.residual_multiplier

    @property
    def sinks(self) -> Tensor | None:
        return self.self_attn.sinks

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend) -> Tensor:
        m = self.residual_multiplier
        if self.sandwich:
            h = self.self_attn(self.input_layernorm(x), cos, sin, attention)
            x = x + self.post_attention_layernorm(h)
            h = self.mlp(self.pre_feedforward_layernorm(x))
            return x + self.post_feedforward_layernorm(h)
        if self.post_norms:
            x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, attention))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention) * m
        return x + self.mlp(self.post_attention_layernorm(x)) * m


class Decoder(nn.Module):
    """Embedding, decoder layers and final norm: Hugging Face's `model.` prefix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.blocks = [DecoderLayer(config, i) for i in range(config.num_layers)]
        """The layers, typed (`nn.ModuleList` yields plain modules); `layers` registers them."""
        self.layers = nn.ModuleList(self.blocks)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.family.gemma)
        self.rotary_emb = RotaryEmbedding(config)
        self.local_rotary_emb = (
            RotaryEmbedding(config, local=True)
            if any(config.local_rope(i) for i in range(config.num_layers))
            else None
        )
        self.embedding_multiplier = config.embedding_multiplier
        self.round_multiplier = config.family.gemma

    def forward(self, token_ids: Tensor, positions: Tensor, attention: AttentionBackend) -> Tensor:
        x = embed(self, token_ids)  # [T, hidden]
        ropes = rotations(self, positions, x.dtype)
        for layer in self.blocks:
            x = layer(x, *ropes[layer.local_rope], attention)
        return self.norm(x)


class _Embeds(Protocol):
    embed_tokens: Embedding
    embedding_multiplier: float
    round_multiplier: bool
    rotary_emb: RotaryEmbedding
    local_rotary_emb: RotaryEmbedding | None


def embed(decoder: _Embeds, token_ids: Tensor) -> Tensor:
    """The token embeddings [T, hidden] times the family's multiplier, a new tensor (the residual
    stream, updated in place by the fused decoder). Gemma rounds √hidden to the model's dtype
    before multiplying, as its checkpoints were trained."""
    x = decoder.embed_tokens(token_ids)
    m = decoder.embedding_multiplier
    if decoder.round_multiplier:
        m = _rounded(m, x.dtype)
    return x.mul_(m) if m != 1.0 else x


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` as `dtype` holds it (once per value and dtype, not on every step)."""
    return float(torch.tensor(value, dtype=dtype))


def rotations(
    decoder: _Embeds, positions: Tensor, dtype: torch.dtype
) -> list[tuple[Tensor, Tensor]]:
    """cos/sin [T, head_dim] of the model's rope, then (where it has one) the sliding layers'
    own: indexed by `DecoderLayer.local_rope`."""
    ropes = [decoder.rotary_emb(positions, dtype)]
    if decoder.local_rotary_emb is not None:
        ropes.append(decoder.local_rotary_emb(positions, dtype))
    return ropes


class LlamaModel(nn.Module):
    """The whole causal LM. `forward` gives final hidden states for every token of a flattened
    batch; `logits` turns the rows you need (usually each sequence's last token) into float32
    next-token logits, so the vocabulary projection is paid only for those rows."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model: Decoder | FusedDecoder = Decoder(config)  # fused in place by `fused.fuse`
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.head: nn.Module | None = None  # the output projection once fused (`fused.fuse`)

    @torch.inference_mode()
    def forward(self, token_ids: Tensor, positions: Tensor, attention: AttentionBackend) -> Tensor:
        """token_ids, positions: LongTensor [T] -> hidden states [T, hidden]. `attention` must
        already know the batch layout (e.g. `ContiguousKVCache.begin_step`)."""
        if token_ids.dim() != 1 or token_ids.shape != positions.shape:
            raise ValueError(
                f"token_ids {list(token_ids.shape)} and positions {list(positions.shape)} must be "
                "1-D tensors of equal length (one flattened batch)"
            )
        return self.model(token_ids, positions, attention)

    def attention_sinks(self) -> list[Tensor | None]:
        """Each layer's attention sinks (gpt-oss), None for a layer without them: what the
        attention backends need beside the config (`layer_attentions`)."""
        return [layer.sinks for layer in self.model.blocks]

    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> logits [N, vocab], float32."""
        if self.head is not None:
            logits = self.head(hidden)
        else:
            lm_head = self.lm_head
            weight = self.model.embed_tokens.weight if lm_head is None else lm_head.weight
            logits = F.linear(hidden, weight)
        scaling, cap = self.config.logits_scaling, self.config.final_softcap
        if scaling != 1.0:
            logits = logits / scaling
        if cap is not None:  # Gemma 2: c · tanh(logits / c), in the model's dtype
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
