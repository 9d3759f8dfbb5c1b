"""The CPU kernels (`kvctl.agent.kernels`) against the torch operations they replace, and the
fused serving model against the model as loaded, with the kernels and without.

Each kernel is held to its torch reference on shapes that reach its edges: tails shorter than a
vector, partly filled pages, pages in several segments, every supported head layout, bfloat16
pages. Where the kernels cannot be used here the kernel tests skip; with
`KVCTL_REQUIRE_CPU_KERNELS=1` (CI sets it) a CPU that could run them but a build that failed (no
compiler, no ninja, a compile error) fails instead, so a broken build is never a silent green.
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
from kvctl.agent.model.llama import RMSNorm
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


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (8, 4, 32), (32, 8, 128), (14, 2, 64), (4, 4, 64), (4, 2, 16), (8, 1, 64)],
)
def test_paged_decode_attention_matches_gather_and_sdpa(heads, kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    page_size, segment_pages, layers = 16, 8, 3
    storage = KVStorage(3, segment_pages, page_size, layers, kv_heads, head_dim, dtype)
    for segment in storage.segments:
        segment.copy_(torch.randn(segment.shape, generator=gen).to(dtype))
    order = torch.randperm(storage.num_pages, generator=gen).tolist()
    lengths = [1, 15, 16, 17, 40, 96]  # one token, partly filled and full last pages
    tables, start = [], 0
    for length in lengths:  # pages scattered over all three segments
        pages = -(-length // page_size)
        tables.append(order[start : start + pages])
        start += pages
    q = torch.randn(len(lengths), heads, head_dim, generator=gen)
    width = max(len(t) for t in tables)
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    for layer in range(layers):
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


@needs_kernels
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 16), (2, 1, 40)])
def test_rotary_in_place_matches_apply_rotary(heads, kv_heads, head_dim):
    rotary = RotaryEmbedding(replace(demo_config(), head_dim=head_dim))
    positions = torch.tensor([0, 1, 7, 300, 4095])
    cos, sin = rotary(positions, torch.float32)
    split = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    qkv = torch.randn(len(positions), sum(split))
    expected = LayerOps().rotary(qkv.clone(), cos, sin, split, head_dim)
    got = KernelLayerOps(ops).rotary(qkv, cos, sin, split, head_dim)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


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
