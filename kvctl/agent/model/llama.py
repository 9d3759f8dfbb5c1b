"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, OLMo 2, Granite, Phi-3, and the
Mixtral and Qwen3-MoE mixtures of experts) over a flattened, variable-length batch; the families'
switches are `config.Family`.

Tokens of all sequences of a step are concatenated into one [T] batch, as in vLLM and nano-vllm:
no padding, each token with its own position. The KV cache is not part of the model; every
attention layer reaches it through the `AttentionBackend` passed to `forward`, so the same model
runs on the contiguous baseline and on the paged pool.

Module and parameter names equal Hugging Face's (`model.layers.{i}.self_attn.q_proj.weight`, ...),
so a checkpoint's state dict loads by name. With tied embeddings there is no `lm_head` module: the
logits reuse `model.embed_tokens.weight`, just as tied checkpoints store no `lm_head.weight`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvctl.agent.model.attention import AttentionBackend
from kvctl.agent.model.config import ModelConfig
from kvctl.agent.model.moe import SparseMoE
from kvctl.agent.model.rope import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:
    from kvctl.agent.model.fused import FusedDecoder


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, then scaled in the input dtype (as Llama does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


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
        if self.qk_norm is not None:  # Qwen3: over each head; OLMo 2: over the projection
            per_head = self.qk_norm == "head"
            self.q_norm = RMSNorm(config.head_dim if per_head else q_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim if per_head else kv_dim, config.rms_norm_eps)
        self.query_scale = config.query_scale

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
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inner = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.down_proj = nn.Linear(inner, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); with post norms
    (OLMo 2) x + norm(attn(x)), then x + norm(mlp(x)). Granite scales each branch by its
    residual multiplier."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.post_norms = config.family.post_norms
        if not self.post_norms:
            self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = SelfAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        if self.post_norms:
            self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp: MLP | SparseMoE
        if config.is_moe_layer(layer_index):
            inner = config.moe_intermediate_size
            experts = [MLP(config, inner) for _ in range(config.num_experts)]
            self.mlp = SparseMoE(config, experts)
        else:
            self.mlp = MLP(config)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend) -> Tensor:
        m = self.residual_multiplier
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
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.embedding_multiplier = config.embedding_multiplier

    def forward(self, token_ids: Tensor, positions: Tensor, attention: AttentionBackend) -> Tensor:
        x = self.embed_tokens(token_ids)  # [T, hidden]
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        cos, sin = self.rotary_emb(positions, x.dtype)  # [T, head_dim] each
        for layer in self.blocks:
            x = layer(x, cos, sin, attention)
        return self.norm(x)


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

    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> logits [N, vocab], float32."""
        if self.head is not None:
            logits = self.head(hidden)
        else:
            lm_head = self.lm_head
            weight = self.model.embed_tokens.weight if lm_head is None else lm_head.weight
            logits = F.linear(hidden, weight)
        scaling = self.config.logits_scaling
        return (logits if scaling == 1.0 else logits / scaling).float()
