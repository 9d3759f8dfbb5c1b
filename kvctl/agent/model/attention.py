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
"""

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] for the T new tokens of
        the batch, laid out sequence after sequence. Stores k and v as the cache of those tokens,
        then returns [T, num_heads, head_dim]: each new token attends causally to its own
        sequence's cached tokens and to the new tokens of its sequence up to and including
        itself."""
        ...


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
    q: Tensor, k_all: Tensor, v_all: Tensor, cached_len: int, mask: Tensor | None = None
) -> Tensor:
    """Causal attention of one sequence's t new tokens.

    q [t, h, d]; k_all, v_all [L, kvh, d] with L = cached_len + t (cached tokens, then the new
    ones). New token i sees keys 0 .. cached_len + i. Returns [t, h, d].

    A single token uses the grouped layout (no mask, no copy). Several tokens go through
    `attend_chunk`; `mask` is `chunk_mask(t, cached_len, ...)` when the caller built it already.
    """
    t, h, d = q.shape
    length, kvh, _ = k_all.shape
    if length != cached_len + t:
        raise ValueError(f"k_all has {length} rows, expected {cached_len} + {t}")
    if t == 1:
        qg = q.view(kvh, h // kvh, d)  # [kvh, g, d]
        out = F.scaled_dot_product_attention(qg, k_all.transpose(0, 1), v_all.transpose(0, 1))
        return out.reshape(1, h, d)
    return attend_chunk(q, k_all, v_all, cached_len, mask)


def chunk_mask(
    t: int, cached_len: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Tensor | None:
    """The additive mask [t, cached_len + t] of t new tokens after `cached_len` cached ones (0
    where a key is visible, -inf elsewhere), or None when nothing is cached (`is_causal` then).

    It depends on the two lengths only, so a step builds it once for all layers; additive and in
    the queries' dtype, because SDPA would turn a boolean mask into this one on every call.
    """
    if not cached_len:
        return None
    hidden = np.triu(np.ones((t, t), dtype=bool), k=1)  # key j > query i within the chunk
    mask = np.zeros((t, cached_len + t), dtype=np.float32)
    mask[:, cached_len:][hidden] = -np.inf
    return torch.from_numpy(mask).to(device=device, dtype=dtype)


def attend_chunk(
    q: Tensor, k_all: Tensor, v_all: Tensor, cached_len: int, mask: Tensor | None = None
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
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k_all.transpose(0, 1).unsqueeze(0),
        v_all.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=not cached_len,
        enable_gqa=True,
    )  # [1, h, t, d]
    return out[0].transpose(0, 1)


def key_mask(lengths: Sequence[int], max_len: int, device: torch.device | str = "cpu") -> Tensor:
    """lengths (B ints) -> Bool [B, max_len] on `device`, True for the keys that exist.

    Built on the host with numpy and moved once: a decode step builds one per step, and on a CPU
    each small torch op costs more dispatch than numpy spends on the whole mask.
    """
    keys = np.arange(max_len)[None, :] < np.asarray(lengths, dtype=np.int64)[:, None]
    return torch.from_numpy(keys).to(device)


def attend_decode(q: Tensor, k: Tensor, v: Tensor, valid: Tensor) -> Tensor:
    """One new token per sequence attending to its whole padded cache, in one SDPA call.

    q [B, h, d]; k, v [B, L, kvh, d] padded per sequence, already holding the new tokens' k/v;
    valid Bool [B, L] from `key_mask` (True for real keys; padding is ignored whatever it holds).
    Returns [B, h, d].
    """
    b, h, d = q.shape
    kvh = k.shape[2]
    qg = q.view(b, kvh, h // kvh, d)  # [B, kvh, g, d]
    mask = valid[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )  # [B, kvh, g, d]
    return out.reshape(b, h, d)


def split_by_sequence(x: Tensor, new_lens: Sequence[int]) -> tuple[Tensor, ...]:
    """x [T, ...] -> one view per sequence, [new_lens[i], ...] each."""
    return torch.split(x, list(new_lens), dim=0)
