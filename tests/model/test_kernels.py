"""The CPU kernels (`kvctl.agent.kernels`) against the torch operations they replace, and the
fused serving model against the model as loaded, with the kernels and without.

Each kernel is held to its torch reference on shapes that reach its edges: tails shorter than a
vector, partly filled pages, pages in several segments, every supported head layout, bfloat16
pages, and for decode attention Gemma's sliding windows and soft-capped scores and gpt-oss's
attention sinks. Where the
kernels cannot be used here the kernel tests skip; with `KVCTL_REQUIRE_CPU_KERNELS=1` (CI sets
it) a CPU that could run them but a build that failed (no compiler, no ninja, a compile error)
fails instead, so a broken build is never a silent green.
"""

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from kv_device import DEVICE

from kvctl.agent.kernels import cpu_ops, unavailable_reason
from kvctl.agent.model import ContiguousKVCache, build_demo_model, demo_config
from kvctl.agent.model.attention import attend_decode, key_mask
from kvctl.agent.model.fused import KernelLayerOps, LayerOps, fuse, uses_kernels
from kvctl.agent.model.llama import RMSNorm, folded_norm
from kvctl.agent.model.projection import PREFILL_ROWS, PackedProjection
from kvctl.agent.model.rope import RotaryEmbedding
from kvctl.agent.pool.storage import KVStorage

_cpu_lacks = (unavailable_reason() or "").startswith(("this CPU lacks", "they need x86-64"))
if os.environ.get("KVCTL_REQUIRE_CPU_KERNELS") == "1" and cpu_ops() is None and not _cpu_lacks:
    pytest.fail(
        f"the CPU kernels are required here but off: {unavailable_reason() or 'build failed'}"
    )

ops = cpu_ops()
needs_kernels = pytest.mark.skipif(ops is None, reason=f"CPU kernels off: {unavailable_reason()}")


def _reference_decode(storage, q, tables, lengths, layer):
    """Gather + SDPA, the path the kernel replaces (`attend_decode`)."""
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + t[-1:] * (width - len(t)) for t in tables])
    keys, values = storage.gather(layer, padded)
    valid = key_mask(lengths, width * storage.page_size)
    return attend_decode(q, keys.float(), values.float(), valid)


def _reference_window_softcap(
    storage, q, tables, lengths, layer, window=0, softcap=0.0, sinks=None
):
    """An explicit softmax in float64 over each sequence's gathered keys, as transformers' eager
    attention does it for Gemma: scores q.k * scale, then softcap * tanh(s / softcap) (none for
    0), and the new token (position L - 1) sees key j iff (L - 1) - j < window (all for 0); with
    `sinks` [heads], as gpt-oss's: each head's sink joins the softmax as one more column, which
    is then dropped."""
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + t[-1:] * (width - len(t)) for t in tables])
    keys, values = storage.gather(layer, padded)  # [B, L, kvh, d]
    batch, heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    grouped = q.double().view(batch, kv_heads, heads // kv_heads, head_dim)
    scores = torch.einsum("bkgd,blkd->bkgl", grouped, keys.double()) * head_dim**-0.5
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    last = torch.tensor(lengths)[:, None] - 1
    position = torch.arange(keys.shape[1])[None, :]
    visible = (position <= last) & ((window == 0) | (last - position < window))
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        column = sinks.double().view(1, kv_heads, heads // kv_heads, 1).expand(batch, -1, -1, 1)
        probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    out = torch.einsum("bkgl,blkd->bkgd", probs, values.double())
    return out.reshape(batch, heads, head_dim).float()


def _scattered_pool(heads, kv_heads, head_dim, dtype, lengths, layers=3, q_scale=1.0):
    """A pool of random pages over three segments, each sequence's pages taken from all of them
    in random order; -> storage, tables (lists of page ids), the int32 table tensor, q."""
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    page_size, segment_pages = 16, 8
    storage = KVStorage(3, segment_pages, page_size, layers, kv_heads, head_dim, dtype)
    for segment in storage.segments:
        segment.copy_(torch.randn(segment.shape, generator=gen).to(dtype))
    order = torch.randperm(storage.num_pages, generator=gen).tolist()
    tables, start = [], 0
    for length in lengths:
        pages = -(-length // page_size)
        tables.append(order[start : start + pages])
        start += pages
    assert start <= storage.num_pages, "the lengths need more pages than the pool has"
    q = torch.randn(len(lengths), heads, head_dim, generator=gen) * q_scale
    width = max(len(t) for t in tables)
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return storage, tables, table_tensor, q


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [
        (9, 3, 64),
        (8, 4, 32),
        (32, 8, 128),
        (14, 2, 64),
        (4, 4, 64),
        (4, 2, 16),
        (8, 1, 64),
        (8, 4, 256),  # Gemma's head size
        (4, 1, 256),
    ],
)
def test_paged_decode_attention_matches_gather_and_sdpa(heads, kv_heads, head_dim, dtype):
    lengths = [1, 15, 16, 17, 40, 96]  # one token, partly filled and full last pages
    storage, tables, table_tensor, q = _scattered_pool(heads, kv_heads, head_dim, dtype, lengths)
    assert ops.decode_supported(str(dtype).removeprefix("torch."), heads // kv_heads, head_dim)
    for layer in range(storage.num_layers):
        got = ops.paged_decode_attention(
            q,
            storage.segments,
            table_tensor,
            torch.tensor(lengths, dtype=torch.int32),
            layer,
            head_dim**-0.5,
        )
        expected = _reference_decode(storage, q, tables, lengths, layer)
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)


LENGTHS = [1, 15, 16, 17, 40, 96, 100]
"""Lengths against windows of 1, 5 (inside a page), 16 (one page), 40 (several pages) and 200
(longer than all): windows that begin mid-page, on a page boundary, and not at all."""
WINDOWS = [1, 5, 16, 40, 200]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 4, 32), (4, 2, 16), (8, 4, 256)]
)
def test_paged_decode_attention_with_a_sliding_window(heads, kv_heads, head_dim, dtype):
    storage, tables, table_tensor, q = _scattered_pool(heads, kv_heads, head_dim, dtype, LENGTHS)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    for window in WINDOWS:
        got = ops.paged_decode_attention(
            q, storage.segments, table_tensor, lengths, 1, head_dim**-0.5, window, 0.0
        )
        expected = _reference_window_softcap(storage, q, tables, LENGTHS, 1, window)
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5, msg=f"window {window}")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 4, 256)])
@pytest.mark.parametrize("softcap", [50.0, 2.0])
def test_paged_decode_attention_soft_caps_the_scores(heads, kv_heads, head_dim, dtype, softcap):
    """Queries scaled up so that scores reach about +-15: a cap of 50 bends the largest by a few
    percent, one of 2 flattens them all (and tanh is taken on both sides of its 0.625 switch)."""
    storage, tables, table_tensor, q = _scattered_pool(
        heads, kv_heads, head_dim, dtype, LENGTHS, q_scale=4.0
    )
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    for window in (0, 20):
        got = ops.paged_decode_attention(
            q, storage.segments, table_tensor, lengths, 1, head_dim**-0.5, window, softcap
        )
        expected = _reference_window_softcap(storage, q, tables, LENGTHS, 1, window, softcap)
        uncapped = _reference_window_softcap(storage, q, tables, LENGTHS, 1, window)
        assert (expected - uncapped).abs().max() > 1e-3  # the cap does change the result
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5, msg=f"window {window}")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 64), (4, 2, 16)])
def test_paged_decode_attention_with_attention_sinks(heads, kv_heads, head_dim, dtype):
    """Sinks from far below the scores (no effect) to far above them (the attention mostly
    sinks), each head its own, with and without gpt-oss's window of the sliding layers."""
    storage, tables, table_tensor, q = _scattered_pool(heads, kv_heads, head_dim, dtype, LENGTHS)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    sinks = torch.linspace(-20.0, 8.0, heads)
    for window in (0, 20):
        got = ops.paged_decode_attention(
            q, storage.segments, table_tensor, lengths, 1, head_dim**-0.5, window, 0.0, sinks
        )
        expected = _reference_window_softcap(storage, q, tables, LENGTHS, 1, window, sinks=sinks)
        plain = _reference_window_softcap(storage, q, tables, LENGTHS, 1, window)
        assert (expected - plain).abs().max() > 0.1  # the sinks do change the result
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5, msg=f"window {window}")
    with pytest.raises(RuntimeError, match="sinks must be"):
        ops.paged_decode_attention(
            q, storage.segments, table_tensor, lengths, 1, 1.0, 0, 0.0, sinks[:-1]
        )


@needs_kernels
def test_paged_decode_attention_refuses_ids_outside_the_pool():
    storage = KVStorage(1, 4, 16, 1, 2, 32)
    q = torch.zeros(1, 4, 32)
    lengths = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.paged_decode_attention(
            q, storage.segments, torch.tensor([[0, 4]], dtype=torch.int32), lengths, 0, 1.0
        )
    with pytest.raises(RuntimeError, match="exceeds its table"):
        ops.paged_decode_attention(
            q, storage.segments, torch.tensor([[0]], dtype=torch.int32), lengths, 0, 1.0
        )
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="window must be"):
        ops.paged_decode_attention(q, storage.segments, table, lengths, 0, 1.0, -1)
    with pytest.raises(RuntimeError, match="softcap must be"):
        ops.paged_decode_attention(q, storage.segments, table, lengths, 0, 1.0, 0, -1.0)


@needs_kernels
def test_paged_decode_attention_reads_no_page_before_the_window():
    """The pages wholly before a window are neither read nor checked (they may be back in the
    pool, their ids stale); an id outside the pool in a page the window reaches is refused, even
    when only its last tokens are in the window."""
    lengths = [40, 96, 33, 17]
    storage, tables, table_tensor, q = _scattered_pool(8, 4, 32, torch.float32, lengths)
    window = 20  # starts at 20, 76, 13 and 0: mid-page, mid-page, in page 0, at the first key
    stale = table_tensor.clone()
    stale[0, 0] = -1
    stale[1, :4] = torch.tensor([2**31 - 1, storage.num_pages, -(2**31), -7])
    got = ops.paged_decode_attention(
        q, storage.segments, stale, torch.tensor(lengths, dtype=torch.int32), 2, 32**-0.5, window
    )
    expected = _reference_window_softcap(storage, q, tables, lengths, 2, window)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)
    # length 32, window 16: page 0 lies wholly before the window, page 1 is all of it
    lengths = torch.tensor([32], dtype=torch.int32)
    pool = storage.segments
    ok = torch.tensor([[-1, 3]], dtype=torch.int32)
    assert ops.paged_decode_attention(q[:1], pool, ok, lengths, 0, 1.0, 16).isfinite().all()
    for bad, length, window in [
        ([[3, -1]], 32, 16),  # the page the window covers
        ([[-1, 3]], 32, 17),  # the window reaches the last key of page 0
        ([[storage.num_pages, 3]], 20, 10),  # starts mid-page 0
        ([[3, 2**31 - 1]], 20, 10),  # the page of the new token
    ]:
        with pytest.raises(RuntimeError, match="outside the pool"):
            table = torch.tensor(bad, dtype=torch.int32)
            ops.paged_decode_attention(
                q[:1], pool, table, torch.tensor([length], dtype=torch.int32), 0, 1.0, window
            )


@needs_kernels
@pytest.mark.parametrize(("out", "inp"), [(960, 576), (3072, 576), (576, 1536), (33, 17), (5, 3)])
@pytest.mark.parametrize("rows", [1, 7, 14, 15, 29, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(out, inp, rows, bias):
    gen = torch.Generator().manual_seed(out + inp + rows)
    weight = torch.randn(out, inp, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    x = torch.randn(rows, inp, generator=gen)
    packed = ops.pack_linear_weight(weight)
    assert packed.shape == (-(-out // 16), inp, 16)
    got = ops.packed_linear(x, packed, b, out)
    # fp32 sums of `inp` products, added in another order than torch's: the rounding grows with
    # the square root of the length (1536 once reached 1.1e-4 under another thread split)
    atol = 1e-4 * max(1.0, (inp / 576) ** 0.5)
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=atol, rtol=1e-5)
    torch.testing.assert_close(got, F.linear(x.T.contiguous().T, weight, b), atol=atol, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize(("out", "inp"), [(960, 576), (33, 17), (3000, 1500)])
@pytest.mark.parametrize("rows", [PREFILL_ROWS - 1, PREFILL_ROWS, 700])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_projection_at_prompt_sizes_matches_f_linear(out, inp, rows, bias):
    """From PREFILL_ROWS rows a small weight goes through sgemm on a row-major copy in the
    thread's workspace (a larger one stays on the kernel): the same product either way, and a
    smaller product after a larger one reads its own weight, not the workspace's leftovers."""
    gen = torch.Generator().manual_seed(out + inp + rows)
    weight = torch.randn(out, inp, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    x = torch.randn(rows, inp, generator=gen)
    projection = PackedProjection(weight, b)
    atol = 1e-4 * max(1.0, (inp / 576) ** 0.5)
    torch.testing.assert_close(projection(x), F.linear(x, weight, b), atol=atol, rtol=1e-5)
    small = PackedProjection(weight[:5, :3].contiguous())
    torch.testing.assert_close(
        small(x[:, :3]), F.linear(x[:, :3], weight[:5, :3]), atol=1e-5, rtol=1e-5
    )


@needs_kernels
@pytest.mark.parametrize("width", [576, 37, 16])
@pytest.mark.parametrize("rows", [1, 8, 100])
def test_layer_steps_match_their_torch_reference(width, rows):
    gen = torch.Generator().manual_seed(width * rows)
    kernel, reference = KernelLayerOps(ops), LayerOps()
    norm = RMSNorm(width, 1e-5)
    norm.weight.data = torch.randn(width, generator=gen)
    x = torch.randn(rows, width, generator=gen)
    torch.testing.assert_close(kernel.rms_norm(x, norm), reference.rms_norm(x, norm))
    a, b = x.clone(), x.clone()
    add = torch.randn(rows, width, generator=gen)
    torch.testing.assert_close(
        kernel.add_rms_norm_(a, add, norm), reference.add_rms_norm_(b, add, norm)
    )
    torch.testing.assert_close(a, b)  # the residual, updated in place by both
    gate_up = torch.randn(rows, 2 * width, generator=gen) * 6
    torch.testing.assert_close(kernel.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    torch.testing.assert_close(kernel.gelu_and_mul(gate_up), reference.gelu_and_mul(gate_up))
    half = gate_up.bfloat16()  # rounded where torch's gelu and product round: within a unit
    torch.testing.assert_close(kernel.gelu_and_mul(half), reference.gelu_and_mul(half))
    gemma = RMSNorm(width, 1e-6, gemma=True)  # (1 + w), folded into a float32 weight
    gemma.weight.data = torch.randn(width, generator=gen) * 0.3
    folded, rows_bf16 = folded_norm(gemma), x.bfloat16()
    assert folded.weight.dtype == torch.float32
    expected = gemma(rows_bf16)  # transformers' Gemma norm: the product in float32, one rounding
    torch.testing.assert_close(kernel.rms_norm(rows_bf16, folded), expected)
    a, b = rows_bf16.clone(), rows_bf16.clone()
    torch.testing.assert_close(
        kernel.add_rms_norm_(a, add.bfloat16(), folded), gemma(b.add_(add.bfloat16()))
    )


@needs_kernels
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "partial"),
    [(9, 3, 64, 1.0), (4, 2, 16, 1.0), (2, 1, 40, 1.0), (24, 8, 128, 0.75), (4, 2, 40, 0.5)],
)
def test_rotary_in_place_matches_apply_rotary(heads, kv_heads, head_dim, partial):
    """Whole heads, and partial ropes (Phi-4-mini's 96 of 128; 20 of 40, a tail shorter than a
    vector), whose unrotated dimensions must come back untouched."""
    config = replace(demo_config(), head_dim=head_dim, partial_rotary_factor=partial)
    rotary = RotaryEmbedding(config)
    positions = torch.tensor([0, 1, 7, 300, 4095])
    cos, sin = rotary(positions, torch.float32)
    split = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    qkv = torch.randn(len(positions), sum(split))
    assert cos.shape[1] == config.rotary_dim
    before = qkv.clone()
    expected = LayerOps().rotary(qkv.clone(), cos, sin, split, head_dim)
    got = KernelLayerOps(ops).rotary(qkv, cos, sin, split, head_dim)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    kept = before.view(len(positions), -1, head_dim)[:, :, config.rotary_dim :]
    assert torch.equal(qkv.view(len(positions), -1, head_dim)[:, :, config.rotary_dim :], kept)


def _logits(model, prompts):
    """Last-token logits of a flattened prefill, then of one decode step, through the
    contiguous cache: the model alone, no engine."""
    cache = ContiguousKVCache(model.config, max_seqs=len(prompts), max_len=64, device=DEVICE)
    layout = cache.begin_step(list(range(len(prompts))), [len(p) for p in prompts])
    tokens = torch.tensor([t for p in prompts for t in p], device=DEVICE)
    hidden = model(tokens, layout.positions(DEVICE), cache)
    first = model.logits(hidden[layout.last_token_indices(DEVICE)])
    layout = cache.begin_step(list(range(len(prompts))), [1] * len(prompts))
    nxt = first.argmax(-1)
    second = model.logits(model(nxt, layout.positions(DEVICE), cache))
    return torch.cat([first, second])


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("tied", [True, False])
def test_fused_model_computes_the_loaded_model(kernels, tied):
    config = replace(demo_config(), tie_word_embeddings=tied)
    prompts = [[1, 5, 9, 200, 33], [7], list(range(40, 70))]
    _, loaded, _ = build_demo_model(DEVICE, torch.float32, seed=4, config=config)
    expected = _logits(loaded, prompts)
    _, model, _ = build_demo_model(DEVICE, torch.float32, seed=4, config=config)
    fuse(model, kernels=kernels)
    assert uses_kernels(model) == (kernels and ops is not None and DEVICE == "cpu")
    assert fuse(model, kernels=not kernels) is model  # once fused, left as it is
    assert uses_kernels(model) == (kernels and ops is not None and DEVICE == "cpu")
    torch.testing.assert_close(_logits(model, prompts), expected, atol=1e-4, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_fills_the_slots_storage_write_fills(dtype):
    gen = torch.Generator().manual_seed(5)
    shape = (3, 4, 16, 2, 3, 32)  # segments, segment pages, page size, layers, KV heads, head dim
    ours, reference = KVStorage(*shape, dtype), KVStorage(*shape, dtype)
    pages = torch.tensor([0, 5, 11, 5, 7])
    offsets = torch.tensor([0, 15, 3, 14, 9])
    qkv = torch.randn(5, 4 * 3 * 32, generator=gen).to(dtype)  # k and v as strided views
    k, v = qkv[:, : 3 * 32].view(5, 3, 32), qkv[:, 3 * 32 : 6 * 32].view(5, 3, 32)
    for layer in range(2):
        ops.write_kv(ours.segments, layer, pages.to(torch.int32), offsets.to(torch.int32), k, v)
        reference.write(layer, pages, offsets, k, v)
    for mine, theirs in zip(ours.segments, reference.segments, strict=True):
        assert torch.equal(mine, theirs)
    with pytest.raises(RuntimeError, match="outside the pool"):
        bad = torch.tensor([12], dtype=torch.int32)
        ops.write_kv(ours.segments, 0, bad, torch.tensor([0], dtype=torch.int32), k[:1], v[:1])
