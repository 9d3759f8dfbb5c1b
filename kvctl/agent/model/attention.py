"""Attention over a flattened batch, and the backend protocol through which the model reaches its
KV cache.

The model never sees how K and V are stored: each layer hands its new q/k/v to an
`AttentionBackend`, which stores k/v and attends. The math lives in two helpers shared by every
backend, so the contiguous baseline and the paged pool compute attention identically and differ
only in where K/V come from:

- `attend_one`: one sequence, t new tokens after `cached_len` cached ones (prefill, chunked
  prefill, prefix-cache hits).
- `attend_decode`: B sequences, one new token each, K/V gathered into a padded [B, L, kvh, d]
  tensor with a key mask: one SDPA call for the whole decode batch.

Query head i reads KV head i // group (group = num_heads // num_kv_heads), as in Hugging Face's
`repeat_kv`. Decode groups the query heads by KV head ([B, kvh, group, d]); several new tokens
pass K/V with their own head count and `enable_gqa=True`. Neither repeats K/V, so reading the
cache costs no copy of it.

A layer may see only a window of keys (`LayerAttention.window`: a query at position p sees keys
p - window + 1 .. p, Gemma's and Mistral's sliding layers), soft-cap its scores (Gemma 2) and
add a learned sink to each softmax's denominator (gpt-oss). Backends trim the keys a window
cannot see before attending and mask the rest; soft-capped scores cannot go through SDPA, so
those layers take `_math_attention`, the formula written out. A sink needs no formula of its
own: with s the sink and lse the log-sum-exp of a query's scores, the softmax over the scores
and the sink is the plain softmax times 1 / (1 + exp(s - lse)) = sigmoid(lse - s), so on a CPU
the flash kernel, which returns lse, computes it (`_sunk_attention`).
"""

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kvctl.agent.model.config import ModelConfig


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] for the T new tokens of
        the batch, laid out sequence after sequence. Stores k and v as the cache of those tokens,
        then returns [T, num_heads, head_dim]: each new token attends causally to its own
        sequence's cached tokens and to the new tokens of its sequence up to and including
        itself."""
        ...


@dataclass(frozen=True)
class LayerAttention:
    """How one layer's queries see the keys: all of them or the last `window` (the query's own
    included), scores as they are or soft-capped as c · tanh(s / c), and `sinks`: a logit per
    query head [heads] (float32) that joins each softmax's denominator and adds no value."""

    window: int | None = None
    softcap: float | None = None
    sinks: Tensor | None = field(default=None, compare=False, repr=False)

    def first_key(self, position: int) -> int:
        """The first key a query at `position` sees."""
        return 0 if self.window is None else max(0, position - self.window + 1)


FULL = LayerAttention()


def layer_attentions(
    config: ModelConfig, sinks: Sequence[Tensor | None] = ()
) -> tuple[LayerAttention, ...]:
    """Each layer's `LayerAttention`, from the model's config and, for a model with attention
    sinks, each layer's sink logits (`LlamaModel.attention_sinks`)."""
    if config.attention_sinks and len(sinks) != config.num_layers:
        raise ValueError(f"{config.name} has attention sinks: give each layer's")
    return tuple(
        LayerAttention(config.window_of(i), config.attn_softcap, _held_sinks(sinks, i))
        for i in range(config.num_layers)
    )


def _held_sinks(sinks: Sequence[Tensor | None], layer: int) -> Tensor | None:
    """Layer `layer`'s sinks as the kernels read them: float32, contiguous, detached."""
    given = sinks[layer] if sinks else None
    return None if given is None else given.detach().float().contiguous()


@dataclass(frozen=True)
class BatchLayout:
    """Which tokens of a flattened batch belong to which sequence, and where each sequence stands.

    Sequence i owns the `new_lens[i]` consecutive tokens starting at `offsets[i]`; it had
    `cached_lens[i]` tokens in the cache before this step, so its new tokens sit at positions
    `cached_lens[i] ... cached_lens[i] + new_lens[i] - 1`.
    """

    seq_ids: tuple[Hashable, ...]
    cached_lens: tuple[int, ...]
    new_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.seq_ids:
            raise ValueError("a step needs at least one sequence")
        if not len(self.seq_ids) == len(self.cached_lens) == len(self.new_lens):
            raise ValueError("seq_ids, cached_lens and new_lens must have one entry per sequence")
        if len(set(self.seq_ids)) != len(self.seq_ids):
            raise ValueError(f"a sequence appears twice in one step: {list(self.seq_ids)}")
        if any(n < 1 for n in self.new_lens):
            raise ValueError(f"every sequence in a step needs ≥ 1 new token, got {self.new_lens}")
        if any(c < 0 for c in self.cached_lens):
            raise ValueError(f"cached lengths must be ≥ 0, got {self.cached_lens}")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.new_lens)

    @property
    def is_decode(self) -> bool:
        """True when every sequence adds exactly one token: the batched decode fast path."""
        return all(n == 1 for n in self.new_lens)

    @property
    def total_lens(self) -> tuple[int, ...]:
        return tuple(c + n for c, n in zip(self.cached_lens, self.new_lens, strict=True))

    @property
    def offsets(self) -> tuple[int, ...]:
        starts, offset = [], 0
        for n in self.new_lens:
            starts.append(offset)
            offset += n
        return tuple(starts)

    def positions(self, device: torch.device | str = "cpu") -> Tensor:
        """Position of every token of the flat batch: LongTensor [T]."""
        ranges = [range(c, c + n) for c, n in zip(self.cached_lens, self.new_lens, strict=True)]
        return torch.tensor([p for r in ranges for p in r], dtype=torch.long, device=device)

    def last_token_indices(self, device: torch.device | str = "cpu") -> Tensor:
        """Index in the flat batch of each sequence's last new token: LongTensor [B], the rows
        whose hidden states give next-token logits."""
        last = [o + n - 1 for o, n in zip(self.offsets, self.new_lens, strict=True)]
        return torch.tensor(last, dtype=torch.long, device=device)


def attend_one(
    q: Tensor,
    k_all: Tensor,
    v_all: Tensor,
    cached_len: int,
    mask: Tensor | None = None,
    seen: LayerAttention = FULL,
) -> Tensor:
    """Causal attention of one sequence's t new tokens.

    q [t, h, d]; k_all, v_all [L, kvh, d] with L = cached_len + t (cached tokens, then the new
    ones). New token i sees keys 0 .. cached_len + i, or those `mask` leaves (a window); `seen`
    gives the soft-cap and sinks (its window is the caller's: trimmed keys, the mask). Returns
    [t, h, d].

    A single token without a mask uses the grouped layout (no copy): a window is applied by
    handing it only the window's keys, or a mask. Several tokens go through `attend_chunk`;
    `mask` is `chunk_mask(t, cached_len, ...)` when the caller built it already.
    """
    t, h, d = q.shape
    length, kvh, _ = k_all.shape
    if length != cached_len + t:
        raise ValueError(f"k_all has {length} rows, expected {cached_len} + {t}")
    if t == 1 and mask is None:
        qg = q.view(kvh, h // kvh, d)  # [kvh, g, d]
        keys, values = k_all.transpose(0, 1), v_all.transpose(0, 1)
        return _attention(qg, keys, values, seen=seen).reshape(1, h, d)
    return attend_chunk(q, k_all, v_all, cached_len, mask, seen)


def chunk_mask(
    t: int,
    cached_len: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    first: int = 0,
) -> Tensor | None:
    """The additive mask [t, cached_len - first + t] of t new tokens after `cached_len` cached
    ones over the keys from position `first` on (0 where a key is visible, -inf elsewhere), or
    None when plain causal attention is the same (`is_causal` then). With a `window`, new token
    i sees keys cached_len + i - window + 1 .. cached_len + i.

    It depends on the lengths only, so a step builds it once for all layers; additive and in
    the queries' dtype, because SDPA would turn a boolean mask into this one on every call.
    """
    sees_all = window is None or cached_len + t <= window
    if cached_len == first == 0 and sees_all:
        return None
    queries = np.arange(cached_len, cached_len + t)[:, None]
    keys = np.arange(first, cached_len + t)[None, :]
    hidden = keys > queries
    if not sees_all:
        assert window is not None
        hidden |= keys <= queries - window
    mask = np.where(hidden, -np.inf, 0.0).astype(np.float32)
    return torch.from_numpy(mask).to(device=device, dtype=dtype)


def attend_chunk(
    q: Tensor,
    k_all: Tensor,
    v_all: Tensor,
    cached_len: int,
    mask: Tensor | None = None,
    seen: LayerAttention = FULL,
) -> Tensor:
    """`attend_one` for several new tokens: one SDPA call over K/V as the cache holds them.

    q [t, h, d]; k_all, v_all [L, kvh, d] with L = cached_len + t, any strides with a
    contiguous last dimension. K/V keep their own head count (`enable_gqa`) rather than being
    repeated per query head, and the operands are 4-D ([1, heads, tokens, d]): with 3-D ones
    SDPA on a CPU falls back to its unfused math kernel, several times slower on a long context.
    """
    t = q.shape[0]
    if mask is None and cached_len:
        mask = chunk_mask(t, cached_len, q.device, q.dtype)
    out = _attention(
        q.transpose(0, 1).unsqueeze(0),
        k_all.transpose(0, 1).unsqueeze(0),
        v_all.transpose(0, 1).unsqueeze(0),
        mask,
        causal=mask is None,
        seen=seen,
    )  # [1, h, t, d]
    return out[0].transpose(0, 1)


def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    causal: bool = False,
    seen: LayerAttention = FULL,
) -> Tensor:
    """SDPA over [..., heads, rows, d] operands (K/V may have fewer heads than q, a divisor),
    `_sunk_attention` where the layer has sinks, `_math_attention` where its scores are
    soft-capped or no kernel returns the log-sum-exp a sink needs."""
    sinks = seen.sinks
    if sinks is not None and seen.softcap is None and _flash_lse_applies(q, mask):
        return _sunk_attention(q, k, v, mask, causal, sinks)
    if seen.softcap is not None or sinks is not None:
        return _math_attention(q, k, v, mask, causal, seen)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=k.shape[-3] != q.shape[-3]
    )


def _flash_lse_applies(q: Tensor, mask: Tensor | None) -> bool:
    """Whether torch's CPU flash kernel takes these operands: 4-D on a CPU, with no mask or an
    additive one of the queries' dtype."""
    plain_mask = mask is None or mask.dtype == q.dtype
    return q.device.type == "cpu" and q.dim() == 4 and plain_mask


def _sunk_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, sinks: Tensor
) -> Tensor:
    """SDPA's output times sigmoid(lse - sink) per query (the module docstring's identity),
    through the CPU flash kernel, which returns each row's log-sum-exp in float32."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask
    )
    share = torch.sigmoid(lse - _sinks_for(q, sinks).squeeze(-1))  # [..., heads, rows]
    return (out * share.unsqueeze(-1).to(out.dtype)).to(q.dtype)


def _sinks_for(q: Tensor, sinks: Tensor) -> Tensor:
    """The sink logits shaped to broadcast over scores [..., heads, rows, keys]: [heads, 1, 1]
    when the rows are tokens, [kv heads, group, 1] in the grouped layouts whose rows are a KV
    head's query heads."""
    return sinks.to(q.device).view(q.shape[-3], -1, 1)


def _math_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, seen: LayerAttention
) -> Tensor:
    """Attention written out as transformers' eager attention computes it (SDPA has no soft-cap
    and no sink): scores in the queries' dtype, soft-capped where the layer caps them, the
    softmax in float32 over the scores and the sink, whose own share is dropped."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if seen.softcap is not None:
        scores = torch.tanh(scores / seen.softcap) * seen.softcap
    if causal:
        rows, cols = scores.shape[-2:]
        hidden = torch.ones(rows, cols, dtype=torch.bool, device=q.device).triu(cols - rows + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    elif mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    if seen.sinks is None:
        return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    sinks = _sinks_for(q, seen.sinks).expand(*scores.shape[:-1], 1)
    probs = F.softmax(torch.cat([scores.float(), sinks], dim=-1), dim=-1)
    return probs[..., :-1].to(q.dtype) @ v


def key_mask(
    lengths: Sequence[int],
    max_len: int,
    device: torch.device | str = "cpu",
    window: int | None = None,
) -> Tensor:
    """lengths (B ints) -> Bool [B, max_len] on `device`, True for the keys that exist (and, with
    a `window`, that the sequence's newest token sees).

    Built on the host with numpy and moved once: a decode step builds one per step, and on a CPU
    each small torch op costs more dispatch than numpy spends on the whole mask.
    """
    ends = np.asarray(lengths, dtype=np.int64)[:, None]
    keys = np.arange(max_len)[None, :] < ends
    if window is not None:
        keys &= np.arange(max_len)[None, :] >= ends - window
    return torch.from_numpy(keys).to(device)


def attend_decode(
    q: Tensor, k: Tensor, v: Tensor, valid: Tensor, seen: LayerAttention = FULL
) -> Tensor:
    """One new token per sequence attending to its whole padded cache, in one SDPA call.

    q [B, h, d]; k, v [B, L, kvh, d] padded per sequence, already holding the new tokens' k/v;
    valid Bool [B, L] from `key_mask` (True for the keys seen; padding is ignored whatever it
    holds). Returns [B, h, d].
    """
    b, h, d = q.shape
    kvh = k.shape[2]
    qg = q.view(b, kvh, h // kvh, d)  # [B, kvh, g, d]
    mask = valid[:, None, None, :]  # [B, 1, 1, L]
    out = _attention(qg, k.transpose(1, 2), v.transpose(1, 2), mask, seen=seen)
    return out.reshape(b, h, d)  # from [B, kvh, g, d]


def split_by_sequence(x: Tensor, new_lens: Sequence[int]) -> tuple[Tensor, ...]:
    """x [T, ...] -> one view per sequence, [new_lens[i], ...] each."""
    return torch.split(x, list(new_lens), dim=0)
