"""The contiguous KV cache: the baseline the paged pool is measured against.

Every sequence owns a slot: per layer, one K and one V region of `max_len` tokens, reserved whole
when the sequence arrives and written in place as it grows. That is how inference servers cached
K/V before paging, with its costs on display: memory is reserved for the longest sequence a slot
might hold (internal fragmentation), and the number of slots, not the tokens in use, caps the
batch.

Storage is one tensor per layer-stack, [layers, slots, max_len, kv_heads, head_dim], so a decode
batch gathers its slots with one `index_select` (or takes a view when the slots are consecutive)
into the padded [B, L, kvh, d] layout that `attend_decode` consumes.
"""

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvctl.agent.model.attention import (
    BatchLayout,
    attend_decode,
    attend_one,
    chunk_mask,
    key_mask,
    layer_attentions,
    split_by_sequence,
)
from kvctl.agent.model.config import ModelConfig
from kvctl.agent.model.errors import KVCacheFull


@dataclass(frozen=True)
class _DecodeIndex:
    """Tensors of one decode step, built once in `begin_step` and reused by every layer."""

    slots: Tensor  # [B] long: slot of each sequence
    write_at: Tensor  # [B] long: position of each sequence's new token
    valid: dict[int | None, Tensor]  # window -> [B, L] bool: keys seen, L = the longest length
    first_slot: int | None  # set when slots are consecutive ascending: a view, no gather


class ContiguousKVCache:
    """An `AttentionBackend` with one preallocated slot of `max_len` tokens per sequence.

    Call `begin_step(seq_ids, new_token_counts)` before each model forward to say which tokens of
    the flat batch belong to which sequence; unknown ids get a free slot. Lengths advance at
    `begin_step`. `free(seq_id)` returns the slot. A step that does not fit raises `KVCacheFull`
    and changes nothing.
    """

    def __init__(
        self,
        config: ModelConfig,
        max_seqs: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        sinks: Sequence[Tensor | None] = (),
    ) -> None:
        """`sinks`: each layer's attention sinks, for a model that has them
        (`LlamaModel.attention_sinks`)."""
        if max_seqs < 1 or max_len < 1:
            raise ValueError(f"max_seqs and max_len must be ≥ 1, got {max_seqs} and {max_len}")
        shape = (config.num_layers, max_seqs, max_len, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # [layers, slots, len, kvh, d]
        self.v = torch.zeros(shape, device=device, dtype=dtype)  # [layers, slots, len, kvh, d]
        self.max_seqs = max_seqs
        self.max_len = max_len
        self.layers = layer_attentions(config, sinks)
        self._free_slots = list(range(max_seqs))  # a heap: lowest free slot first
        self._slot: dict[Hashable, int] = {}
        self._len: dict[Hashable, int] = {}
        self._layout: BatchLayout | None = None
        self._decode: _DecodeIndex | None = None

    @property
    def nbytes(self) -> int:
        """Bytes reserved for K and V, in use or not."""
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def length(self, seq_id: Hashable) -> int:
        """Tokens cached for `seq_id` (0 for a sequence the cache does not hold)."""
        return self._len.get(seq_id, 0)

    def begin_step(
        self, seq_ids: Sequence[Hashable], new_token_counts: Sequence[int]
    ) -> BatchLayout:
        """Lay out the next forward: sequence i contributes `new_token_counts[i]` consecutive tokens
        of the flat batch, in the order given. Returns the layout (positions, last-token rows)."""
        if len(seq_ids) != len(new_token_counts):
            raise ValueError("begin_step needs one new-token count per sequence id")
        layout = BatchLayout(
            tuple(seq_ids), tuple(self.length(s) for s in seq_ids), tuple(new_token_counts)
        )
        self._check_fits(layout)
        for seq_id, total in zip(seq_ids, layout.total_lens, strict=True):
            if seq_id not in self._slot:
                self._slot[seq_id] = heapq.heappop(self._free_slots)
            self._len[seq_id] = total
        self._layout = layout
        self._decode = self._decode_index(layout) if layout.is_decode else None
        return layout

    def free(self, seq_id: Hashable) -> None:
        """Release the slot of a finished or preempted sequence."""
        if seq_id not in self._slot:
            raise KeyError(f"sequence {seq_id!r} is not in the KV cache")
        heapq.heappush(self._free_slots, self._slot.pop(seq_id))
        del self._len[seq_id]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """See `AttentionBackend.attend`."""
        layout = self._layout
        if layout is None:
            raise RuntimeError("call begin_step(seq_ids, new_token_counts) before the forward")
        if q.shape[0] != layout.num_tokens:
            raise ValueError(
                f"the forward has {q.shape[0]} tokens but begin_step laid out "
                f"{layout.num_tokens}; call begin_step for every forward"
            )
        if self._decode is not None:
            return self._attend_decode(layer, q, k, v, self._decode)
        return self._attend_each(layer, q, k, v, layout)

    def _attend_decode(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, idx: _DecodeIndex
    ) -> Tensor:
        self.k[layer, idx.slots, idx.write_at] = k  # k [B, kvh, d]
        self.v[layer, idx.slots, idx.write_at] = v
        seen = self.layers[layer]
        valid = idx.valid[seen.window]
        length = valid.shape[1]
        if idx.first_slot is not None:
            rows = slice(idx.first_slot, idx.first_slot + len(idx.slots))
            keys, values = self.k[layer, rows, :length], self.v[layer, rows, :length]
        else:
            keys = self.k[layer, :, :length].index_select(0, idx.slots)  # [B, L, kvh, d]
            values = self.v[layer, :, :length].index_select(0, idx.slots)
        return attend_decode(q, keys, values, valid, seen)

    def _attend_each(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, layout: BatchLayout
    ) -> Tensor:
        outs = []
        per_seq = zip(
            layout.seq_ids,
            layout.cached_lens,
            split_by_sequence(q, layout.new_lens),
            split_by_sequence(k, layout.new_lens),
            split_by_sequence(v, layout.new_lens),
            strict=True,
        )
        seen = self.layers[layer]
        for seq_id, cached, q_i, k_i, v_i in per_seq:
            slot, t = self._slot[seq_id], q_i.shape[0]
            end = cached + t
            self.k[layer, slot, cached:end] = k_i  # [t, kvh, d]
            self.v[layer, slot, cached:end] = v_i
            first = seen.first_key(cached)  # the keys before it no new token sees
            keys, values = self.k[layer, slot, first:end], self.v[layer, slot, first:end]
            mask = chunk_mask(t, cached, q.device, q.dtype, seen.window, first) if t > 1 else None
            outs.append(attend_one(q_i, keys, values, cached - first, mask, seen))
        return torch.cat(outs)  # [T, h, d]

    def _check_fits(self, layout: BatchLayout) -> None:
        arriving = sum(1 for s in layout.seq_ids if s not in self._slot)
        if arriving > len(self._free_slots):
            raise KVCacheFull(
                f"{arriving} new sequences but {len(self._free_slots)} free slots of "
                f"{self.max_seqs}; free finished sequences or build the cache with more slots"
            )
        for seq_id, total in zip(layout.seq_ids, layout.total_lens, strict=True):
            if total > self.max_len:
                raise KVCacheFull(
                    f"sequence {seq_id!r} would reach {total} tokens, past the slot length "
                    f"{self.max_len}; stop it earlier or build the cache with a larger max_len"
                )

    def _decode_index(self, layout: BatchLayout) -> _DecodeIndex:
        device = self.k.device
        slot_list = [self._slot[s] for s in layout.seq_ids]
        consecutive = slot_list == list(range(slot_list[0], slot_list[0] + len(slot_list)))
        return _DecodeIndex(
            slots=torch.tensor(slot_list, dtype=torch.long, device=device),
            write_at=torch.tensor(layout.cached_lens, dtype=torch.long, device=device),
            valid={
                window: key_mask(layout.total_lens, max(layout.total_lens), device, window)
                for window in {seen.window for seen in self.layers}
            },
            first_slot=slot_list[0] if consecutive else None,
        )
