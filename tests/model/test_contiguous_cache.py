"""The shared attention helpers and the contiguous KV cache."""

import math

import pytest
import torch
import torch.nn.functional as F
from kv_device import DEVICE

from kvctl.agent.model import (
    BatchLayout,
    ContiguousKVCache,
    KVCacheFull,
    attend_decode,
    attend_one,
    key_mask,
)
from kvctl.agent.model.attention import chunk_mask


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int) -> torch.Tensor:
    """Written-out reference: q [t, h, d], k/v [L, kvh, d]; query head i reads KV head
    i // (h // kvh); new token i sees keys 0 .. cached + i."""
    t, h, d = q.shape
    group = h // k.shape[1]
    out = torch.empty_like(q)
    for i in range(t):
        for head in range(h):
            keys = k[: cached + i + 1, head // group]  # [n, d]
            weights = torch.softmax(keys @ q[i, head] / math.sqrt(d), dim=0)
            out[i, head] = weights @ v[: cached + i + 1, head // group]
    return out


@pytest.mark.parametrize(("t", "cached"), [(1, 0), (5, 0), (1, 9), (4, 6)])
def test_attend_one_matches_written_out_attention(t, cached):
    gen = torch.Generator().manual_seed(t * 10 + cached)
    q = torch.randn(t, 8, 16, generator=gen)
    k, v = torch.randn(2, cached + t, 2, 16, generator=gen)
    torch.testing.assert_close(attend_one(q, k, v, cached), naive_attention(q, k, v, cached))


@pytest.mark.parametrize(("t", "cached"), [(1, 3), (4, 0), (4, 6), (7, 1)])
def test_chunk_mask_lets_new_token_i_see_keys_up_to_cached_plus_i(t, cached):
    mask = chunk_mask(t, cached)
    if not cached:
        assert mask is None  # SDPA's is_causal covers it, with no mask tensor at all
        return
    visible = torch.arange(cached + t)[None, :] <= torch.arange(t)[:, None] + cached
    assert mask.shape == (t, cached + t) and mask.dtype == torch.float32
    assert torch.equal(mask == 0, visible) and bool((mask[~visible] == -math.inf).all())


def test_a_chunk_reaches_sdpa_as_4d_operands_with_the_kv_heads_unrepeated(monkeypatch):
    """3-D operands send a CPU's SDPA to its unfused math kernel, and repeating K/V per query
    head copies the whole context per layer: the chunk path must do neither."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        calls.append((q.shape, k.shape, kwargs))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(5, 8, 16, generator=gen)
    k, v = torch.randn(2, 11, 2, 16, generator=gen)
    attend_one(q, k, v, cached_len=6)
    [(q_shape, k_shape, kwargs)] = calls
    assert (tuple(q_shape), tuple(k_shape)) == ((1, 8, 5, 16), (1, 2, 11, 16))
    assert kwargs["enable_gqa"] and kwargs["attn_mask"].shape == (5, 11)


def test_attend_decode_equals_attend_one_per_sequence_and_ignores_padding():
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 11, 1, 7]
    q = torch.randn(4, 8, 16, generator=gen)  # [B, h, d]
    k, v = torch.randn(2, 4, 11, 2, 16, generator=gen)  # [B, L, kvh, d]
    valid = key_mask(lengths, 11)
    k[~valid], v[~valid] = 1e4, -1e4  # padding that would dominate if it leaked in
    out = attend_decode(q, k, v, valid)
    for b, n in enumerate(lengths):
        expected = attend_one(q[b : b + 1], k[b, :n], v[b, :n], cached_len=n - 1)[0]
        torch.testing.assert_close(out[b], expected)


def test_batch_layout_positions_and_rows():
    layout = BatchLayout(seq_ids=("a", "b", "c"), cached_lens=(0, 5, 2), new_lens=(3, 1, 2))
    assert layout.positions().tolist() == [0, 1, 2, 5, 2, 3]
    assert layout.last_token_indices().tolist() == [2, 3, 5]
    assert layout.offsets == (0, 3, 4)
    assert layout.total_lens == (3, 6, 4)
    assert (layout.num_tokens, layout.num_seqs, layout.is_decode) == (6, 3, False)


@pytest.mark.parametrize(
    ("seq_ids", "cached", "new", "message"),
    [
        ((), (), (), "at least one sequence"),
        (("a", "a"), (0, 0), (1, 1), "appears twice"),
        (("a",), (0,), (0,), "≥ 1 new token"),
        (("a", "b"), (0,), (1, 1), "one entry per sequence"),
    ],
)
def test_batch_layout_rejects_bad_steps(seq_ids, cached, new, message):
    with pytest.raises(ValueError, match=message):
        BatchLayout(seq_ids, cached, new)


def test_incremental_decode_equals_full_prefill(demo):
    """Logits of tokens decoded through the cache (in a mixed batch where another sequence is
    prefilling) equal those of recomputing the whole sequence from scratch."""
    config, model, _ = demo
    gen = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 256, (24,), generator=gen).to(DEVICE)
    other = torch.randint(0, 256, (9,), generator=gen).to(DEVICE)
    cache = ContiguousKVCache(config, max_seqs=3, max_len=32, device=DEVICE)
    layout = cache.begin_step(["s"], [20])
    model(seq[:20], layout.positions(DEVICE), cache)
    decoded = []
    for i in range(20, 24):
        ids = ["late", "s"] if i == 21 else ["s"]
        tokens = torch.cat([other, seq[i : i + 1]]) if i == 21 else seq[i : i + 1]
        layout = cache.begin_step(ids, [9, 1] if i == 21 else [1])
        hidden = model(tokens, layout.positions(DEVICE), cache)
        decoded.append(model.logits(hidden[-1:]))
    fresh = ContiguousKVCache(config, max_seqs=1, max_len=32, device=DEVICE)
    layout = fresh.begin_step(["s"], [24])
    full = model.logits(model(seq, layout.positions(DEVICE), fresh))
    torch.testing.assert_close(torch.cat(decoded), full[20:], atol=1e-4, rtol=1e-4)


def test_full_cache_refuses_and_changes_nothing(demo):
    config = demo[0]
    cache = ContiguousKVCache(config, max_seqs=2, max_len=8)
    cache.begin_step(["a", "b"], [4, 4])
    with pytest.raises(KVCacheFull, match="1 new sequences but 0 free slots of 2"):
        cache.begin_step(["a", "c"], [1, 1])
    with pytest.raises(KVCacheFull, match="'b' would reach 9 tokens, past the slot length 8"):
        cache.begin_step(["a", "b"], [1, 5])
    assert (cache.length("a"), cache.length("b"), cache.length("c")) == (4, 4, 0)
    assert cache.num_free_slots == 0


def test_free_returns_the_lowest_slot_first(demo):
    config = demo[0]
    cache = ContiguousKVCache(config, max_seqs=3, max_len=8)
    cache.begin_step(["a", "b", "c"], [1, 1, 1])
    cache.free("c")
    cache.free("a")
    layout = cache.begin_step(["d"], [2])
    assert layout.cached_lens == (0,)
    assert cache._slot["d"] == 0
    with pytest.raises(KeyError, match="'a' is not in the KV cache"):
        cache.free("a")
    assert cache.nbytes == 2 * 4 * 3 * 8 * 4 * 32 * 4  # K and V, [layers, slots, len, kvh, d] fp32


def test_attend_before_begin_step_says_what_to_do(demo):
    config = demo[0]
    cache = ContiguousKVCache(config, max_seqs=1, max_len=4)
    with pytest.raises(RuntimeError, match="call begin_step"):
        cache.attend(0, torch.zeros(1, 8, 32), torch.zeros(1, 4, 32), torch.zeros(1, 4, 32))
