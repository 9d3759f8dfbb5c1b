"""GGUF loading: files written the way llama.cpp's convert_hf_to_gguf writes them (tensor names,
Q/K rows permuted for its interleaved rotary, Gemma's norms stored as 1 + w, tokenizer and chat
template in the metadata), read back by kvctl and, as the reference, by transformers' own GGUF
loader."""

import json
import math
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hf_reference import SHAPE, hf_greedy, peaked_weights
from hf_reference import VARIANTS as HF_VARIANTS
from kv_device import DEVICE

from kvctl.agent.model import (
    CheckpointError,
    ContiguousKVCache,
    LlamaModel,
    SamplingParams,
    build_demo_model,
    load_checkpoint,
)
from kvctl.agent.runtime import Engine, EngineConfig
from kvctl.settings import DefragSettings

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

QTYPES = {"F32": 0, "F16": 1, "Q8_0": 8}  # GGMLQuantizationType values; compared with transformers
SPECIALS = ["<|pad|>", "<|begin_of_text|>", "<|end_of_text|>"]  # ids 0, 1, 2 as in SHAPE
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXTS = ["hello world", "the paged kv cache!", "  two spaces\nand a newline", "ünïcödé 1234567"]
_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GEMMA_ARCHS = {
    "gemma": gguf.MODEL_ARCH.GEMMA,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
}


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's `LlamaModel.permute`: half-split rotary rows to interleaved pairs."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(
    path: Path,
    state: dict[str, torch.Tensor],
    hf: dict[str, Any],
    qtype: str = "F32",
    arch: str = "llama",
    tokenizer: dict[str, Any] | None = None,
    extra: dict[str, np.ndarray] | None = None,
    pre: str = "llama-bpe",
    add_bos: bool = True,
    raw: dict[str, np.ndarray] | None = None,
    extra_2d: dict[str, np.ndarray] | None = None,
) -> Path:
    """A GGUF file as llama.cpp's converter writes it; 1-D tensors stay F32, as llama.cpp keeps
    norms and biases. `raw` holds already quantized `qtype` blocks, by GGUF tensor name, for the
    types the gguf package cannot quantize (K-quants); they are stored as they are. `extra_2d`:
    more tensors by GGUF name, matrices and stacks of them, stored as `qtype`."""
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    writer.add_name(path.stem)
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if arch in GEMMA_ARCHS:
        _gemma_metadata(writer, hf, arch)
    elif arch == "phi3":
        _phi3_metadata(writer, hf, head_dim)
    elif arch == "qwen3moe":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_freq_base(hf["rope_theta"])
        writer.add_expert_count(hf["num_experts"])
        writer.add_expert_used_count(hf["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    else:
        writer.add_rope_dimension_count(head_dim)
        if head_dim != hf["hidden_size"] // heads:
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        writer.add_rope_freq_base(hf["rope_theta"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_vocab_size(hf["vocab_size"])
    writer.add_file_type(_file_type(qtype))
    writer.add_bos_token_id(hf["bos_token_id"])
    writer.add_eos_token_id(hf["eos_token_id"])
    if tokenizer is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokenizer["tokens"])
        writer.add_token_types([3 if t in SPECIALS else 1 for t in tokenizer["tokens"]])
        writer.add_token_merges(tokenizer["merges"])
        writer.add_add_bos_token(add_bos)
        writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in state.items():
        converted = _converted(name, tensor, hf, arch)
        if converted is None:
            continue
        target, values = converted
        if raw is not None and target in raw:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(target, raw[target], raw_dtype=kind)
        else:
            _add(writer, target, values, qtype if values.ndim == 2 else "F32")
    for target, values in (extra or {}).items():
        _add(writer, target, values, "F32")
    for target, values in (extra_2d or {}).items():
        _add(writer, target, values, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _converted(
    name: str, tensor: torch.Tensor, hf: dict[str, Any], arch: str
) -> tuple[str, np.ndarray] | None:
    """The GGUF name and values convert_hf_to_gguf writes for one Hugging Face tensor of an `arch`
    model; None for one it drops."""
    values = tensor.float().numpy()
    if arch == "phi3":  # no Q/K permutation; qkv and gate_up stay fused (attn_qkv, ffn_up)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, hf["num_hidden_layers"])
        stem, suffix = name.rsplit(".", 1)
        return f"{names.get_name(stem)}.{suffix}", values
    if arch in GEMMA_ARCHS:
        if name == "lm_head.weight":  # dropped: llama.cpp's Gemma reuses token_embd
            return None
        names = gguf.get_tensor_name_map(GEMMA_ARCHS[arch], hf["num_hidden_layers"])
        stem, suffix = name.rsplit(".", 1)
        if name.endswith("norm.weight"):  # Gemma's norms are stored as the scale 1 + w
            values = values + np.float32(1.0)
        return f"{names.get_name(stem)}.{suffix}", values
    if name.startswith("model.layers."):
        _, _, layer, *rest = name.split(".")
        target = f"blk.{layer}.{_BLOCK['.'.join(rest[:-1])]}.{rest[-1]}"
    else:
        target = _TOP[name]
    if arch == "llama" and ".q_proj." in name:
        values = permute(values, hf["num_attention_heads"])
    elif arch == "llama" and ".k_proj." in name:
        values = permute(values, hf["num_key_value_heads"])
    return target, values


def _phi3_metadata(writer: Any, hf: dict[str, Any], head_dim: int) -> None:
    """convert_hf_to_gguf's Phi3MiniModel: the rotated dimensions, the window, and for longrope
    its original context and attention factor (the factors themselves go in as tensors)."""
    writer.add_rope_dimension_count(int(head_dim * hf.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(hf["rope_theta"])
    if hf.get("sliding_window"):
        writer.add_sliding_window(hf["sliding_window"])
    scaling = hf.get("rope_scaling")
    if scaling is not None:
        original = hf["original_max_position_embeddings"]
        factor = hf["max_position_embeddings"] / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(original)))


def _gemma_metadata(writer: Any, hf: dict[str, Any], arch: str) -> None:
    """What convert_hf_to_gguf's GemmaModel / Gemma2Model / Gemma3Model write beyond the common
    keys (no rope dimension count, no Q/K permutation), and the two keys newer llama.cpp reads
    for Gemma 3 that the converter does not write: a sliding pattern other than 6, the sliding
    layers' rope base where it is not 10,000."""
    writer.add_key_length(hf["head_dim"])
    writer.add_value_length(hf["head_dim"])
    if arch == "gemma":  # no rope base either: llama.cpp's 10,000
        return
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(hf["final_logit_softcapping"])
        writer.add_sliding_window(hf["sliding_window"])
        return
    writer.add_rope_freq_base(hf["rope_theta"])  # the full layers'
    if hf.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(hf["final_logit_softcapping"])
    if hf.get("sliding_window_pattern") != 1:
        writer.add_sliding_window(hf["sliding_window"])
    scaling = hf.get("rope_scaling")
    if scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    if hf.get("sliding_window_pattern", 6) != 6:
        writer.add_sliding_window_pattern(hf["sliding_window_pattern"])
    if hf.get("rope_local_base_freq", 10000.0) != 10000.0:
        writer.add_rope_freq_base_swa(hf["rope_local_base_freq"])


def _file_type(qtype: str) -> int:
    """general.file_type of a file whose matrices are `qtype`."""
    names = {"F32": "ALL_F32", "Q4_K": "MOSTLY_Q4_K_M"}
    return int(gguf.LlamaFileType[names.get(qtype, f"MOSTLY_{qtype}")])


def _add(writer: Any, name: str, values: np.ndarray, qtype: str) -> None:
    kind = gguf.GGMLQuantizationType[qtype]
    data = gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), kind)
    writer.add_tensor(name, data, raw_dtype=kind)


@pytest.fixture(scope="module")
def bpe() -> dict[str, Any]:
    """A tiny byte-level BPE (3 specials, 256 bytes, some merges), as `tokens` and `merges`."""
    models, pre, trainers = tokenizers.models, tokenizers.pre_tokenizers, tokenizers.trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=SPECIALS,
        initial_alphabet=pre.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the paged kv cache holds keys", "hello world 123"] * 20, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {"tokens": tokens, "merges": merges}


def _logits(model: LlamaModel, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Prefill logits of every prompt token, all prompts in one flattened batch."""
    config = model.config
    cache = ContiguousKVCache(
        config, len(prompts), max_len=64, device=DEVICE, sinks=model.attention_sinks()
    )
    layout = cache.begin_step(list(range(len(prompts))), [len(p) for p in prompts])
    tokens = torch.tensor([t for p in prompts for t in p], device=DEVICE)
    return model.logits(model(tokens, layout.positions(DEVICE), cache)).cpu()


def _engine_greedy(model: LlamaModel, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """Greedy tokens through the agent's engine: scheduler, paged pool, paged attention."""
    config = EngineConfig(
        page_size=4,
        pool_pages=64,
        segment_pages=16,
        defrag=DefragSettings(enabled=False),
        device=DEVICE,
    )
    engine = Engine(model, None, config)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [list(r.output_ids) for r in engine.generate(prompts, params)]


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (7, 1, 19)]


# ---- (a) the demo model, written as F32, loads bit for bit ---------------------------------


def test_demo_model_round_trips_exactly(tmp_path: Path):
    config, demo, _ = build_demo_model(DEVICE)
    hf = {
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "intermediate_size": config.intermediate_size,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "vocab_size": config.vocab_size,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids[0],
    }
    state = {k: v.cpu() for k, v in demo.state_dict().items()}
    path = write_gguf(tmp_path / "demo.gguf", state, hf)
    loaded_config, model, tokenizer = load_checkpoint(path, DEVICE)
    assert tokenizer is None  # no vocabulary in the file
    assert loaded_config.name == "demo" and loaded_config.torch_dtype == "float32"
    assert loaded_config == config
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, demo.state_dict()[name]), name
    prompts = _prompts(256, seed=1)
    assert torch.equal(_logits(model, prompts), _logits(demo, prompts))
    assert _engine_greedy(model, prompts, 12) == _engine_greedy(demo, prompts, 12)


# ---- (b) a tiny Hugging Face model against transformers' GGUF loader -----------------------

VARIANTS = {  # name: (transformers class, GGUF architecture, config extras)
    "llama": ("LlamaForCausalLM", "llama", {}),
    "qwen2-tied": ("Qwen2ForCausalLM", "qwen2", {"tie_word_embeddings": True}),
    # q/k norms; head_dim 128, the default transformers' GGUF loader assumes for Qwen3
    "qwen3": ("Qwen3ForCausalLM", "qwen3", {"head_dim": 128}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def reference(request, bpe) -> tuple[Any, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    model_cls, arch, extra = VARIANTS[request.param]
    config_cls = getattr(transformers, model_cls.replace("ForCausalLM", "Config"))
    hf = {**SHAPE, "vocab_size": len(bpe["tokens"]), "rms_norm_eps": 1e-6, **extra}
    model = getattr(transformers, model_cls)(config_cls(**hf)).eval()
    peaked_weights(model, seed=len(request.param))
    theta = getattr(model.config, "rope_theta", None) or model.config.rope_parameters["rope_theta"]
    return model, {**hf, "rope_theta": theta, "arch": arch}


@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_matches_transformers_gguf_loading(reference, bpe, qtype, generate, tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    model, hf = reference
    state = model.state_dict()
    if hf.get("tie_word_embeddings"):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    path = write_gguf(tmp_path / "tiny.gguf", state, hf, qtype, hf["arch"], bpe)
    expected = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    expected_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    config, ours, tokenizer = load_checkpoint(path, DEVICE, torch.float32)
    assert tokenizer is not None
    assert config.torch_dtype == ("float32" if qtype == "F32" else "float16")
    assert config.tie_word_embeddings == bool(hf.get("tie_word_embeddings"))
    assert config.chat_template is not None
    assert config.chat_template.source == CHAT_TEMPLATE == expected_tok.chat_template
    chat = [{"role": "user", "content": "hello world"}]
    rendered = config.chat_template.render(chat)
    want = expected_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == want
    want_ids = expected_tok(want, add_special_tokens=False).input_ids
    assert tokenizer.encode(rendered, add_special_tokens=False) == want_ids
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == expected_tok(text).input_ids, text
        assert ids[0] == 1 and tokenizer.decode(ids) == text
    prompts = [tokenizer.encode(t) for t in TEXTS]
    _assert_same_as_transformers(ours, expected, prompts, generate)


def test_quantized_weights_are_close_to_the_originals(reference, bpe, tmp_path: Path):
    """Q8_0 costs a little precision (one scale per 32 weights), not correctness."""
    model, hf = reference
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    hf = {**hf, "tie_word_embeddings": True}
    path = write_gguf(tmp_path / "q8.gguf", state, hf, "Q8_0", hf["arch"], bpe)
    _, ours, _ = load_checkpoint(path, "cpu")
    assert next(ours.parameters()).dtype == torch.float16
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(tensor.float(), state[name], atol=0.02, rtol=0.02)


# ---- the common quantized types, and a SmolLM2-shaped Q4_1 file ----------------------------

QUANTIZED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"]
_STEP = {"Q4_0": 8, "Q4_1": 8, "Q5_0": 16, "Q5_1": 16, "Q8_0": 64}  # max |w| / this bounds errors
_K_BLOCKS = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}  # bytes a block, offsets of fp16 scales


def _random_state(hf: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face named weights of the decoder `hf` describes, drawn from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inner = hf["hidden_size"], hf["intermediate_size"]
    kv = hidden // hf["num_attention_heads"] * hf["num_key_value_heads"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (hf["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    parts = {
        "input_layernorm": (hidden,),
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "post_attention_layernorm": (hidden,),
        "mlp.gate_proj": (inner, hidden),
        "mlp.up_proj": (inner, hidden),
        "mlp.down_proj": (hidden, inner),
    }
    for layer in range(hf["num_hidden_layers"]):
        for part, shape in parts.items():
            shapes[f"model.layers.{layer}.{part}.weight"] = shape
    return {name: 0.1 * torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _k_blocks(kind: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (the gguf package cannot quantize to these) with sane fp16 scales."""
    size, scales = _K_BLOCKS[kind]
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // 256, size), dtype=np.uint8)
    for at in scales:
        values = rng.uniform(1e-3, 1e-2, len(blocks)).astype(np.float16)
        blocks[:, at : at + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(shape[0], -1)


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_common_quantized_types_load(qtype: str, tmp_path: Path):
    """Q4_1 (SmolLM2's GGUF), Q4_0, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K load, dequantized to what
    the file holds: exactly what transformers' own dequantizer (not the gguf package kvctl uses)
    makes of the stored blocks where it has the type, and within the type's precision of the
    unquantized weights where the gguf package could quantize them."""
    hf = {
        **SHAPE,
        "hidden_size": 256,  # K-quant blocks hold 256 values of a row
        "intermediate_size": 256,
        "num_hidden_layers": 1,
        "vocab_size": 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }
    state = _random_state(hf, seed=QUANTIZED.index(qtype))
    try:
        from transformers.integrations.gguf.dequant import GGML_BLOCK
        from transformers.integrations.gguf.dequant import dequantize as hf_dequantize
    except ImportError:
        GGML_BLOCK, hf_dequantize = {}, None
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype not in _STEP and int(kind) not in GGML_BLOCK:
        pytest.skip(f"no reference for {qtype}: transformers' dequantizer is not installed")
    raw = None
    if qtype in _K_BLOCKS:
        rng = np.random.default_rng(0)
        matrices = [n for n, tensor in state.items() if tensor.ndim == 2]
        raw = {_gguf_name(n): _k_blocks(qtype, tuple(state[n].shape), rng) for n in matrices}
    path = write_gguf(tmp_path / f"{qtype}.gguf", state, hf, qtype, raw=raw)
    config, ours, _ = load_checkpoint(path, "cpu", torch.float32)
    assert config.tie_word_embeddings
    loaded = ours.state_dict()
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name, original in state.items():
        if original.ndim == 1:
            continue
        values = loaded[name].numpy()
        if ".q_proj." in name or ".k_proj." in name:  # back to the file's row order
            heads = hf["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
            values = permute(values, heads)
        if qtype in _STEP:
            bound = float(original.abs().max()) / _STEP[qtype]
            torch.testing.assert_close(loaded[name], original, atol=bound, rtol=0)
        if hf_dequantize is not None and int(kind) in GGML_BLOCK:
            data = torch.from_numpy(np.array(stored[_gguf_name(name)].data))
            want = hf_dequantize(data.reshape(-1), int(kind)).reshape(values.shape)
            torch.testing.assert_close(torch.from_numpy(values), want, atol=1e-6, rtol=1e-6)


def _gguf_name(name: str) -> str:
    """The GGUF tensor name of a Hugging Face parameter name."""
    if name in _TOP:
        return _TOP[name]
    _, _, layer, *rest = name.split(".")
    return f"blk.{layer}.{_BLOCK['.'.join(rest[:-1])]}.{rest[-1]}"


def test_smollm2_shaped_q4_1_file_loads_and_generates(bpe, generate, tmp_path: Path):
    """A file shaped like SmolLM2's GGUF, which kvctl used to refuse: architecture llama,
    tokenizer.ggml.pre "smollm", Q4_1 weights, tied embeddings, no BOS. It loads through the
    agent's GGUF path; digits are split one by one as llama.cpp's SMOLLM pre-type does (the ids are
    checked against llama.cpp's rules in test_gguf_pretokenizers.py: transformers knows no
    "smollm" and would cut "12345678" with GPT-2's regex); logits and greedy tokens, through the
    model and through the engine, match transformers' model read from the same file."""
    transformers = pytest.importorskip("transformers")
    hf = {
        **SHAPE,
        "hidden_size": 96,  # SmolLM2-135M: 9 heads over 3 KV heads of 64; here 3 over 1 of 32
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "intermediate_size": 256,
        "vocab_size": len(bpe["tokens"]),
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    }
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf)).eval()
    peaked_weights(model, seed=135)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    path = write_gguf(
        tmp_path / "smol.gguf", state, hf, "Q4_1", "llama", bpe, pre="smollm", add_bos=False
    )
    config, ours, tokenizer = load_checkpoint(path, DEVICE, torch.float32)
    assert tokenizer is not None and config.tie_word_embeddings
    assert config.torch_dtype == "float16"
    vocab = {t: i for i, t in enumerate(bpe["tokens"])}
    assert tokenizer.encode("12345678") == [vocab[d] for d in "12345678"]  # no BOS, one a digit
    prompts = [tokenizer.encode(t) for t in ["hello world 2024", "the paged kv cache", "42"]]
    for text, prompt in zip(["hello world 2024", "the paged kv cache", "42"], prompts, strict=True):
        assert tokenizer.decode(prompt) == text
    expected = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    _assert_same_as_transformers(ours, expected, prompts, generate)


# ---- Gemma 2 and Gemma 3 (text) ------------------------------------------------------------

GEMMA = {  # name: (transformers config and model classes, GGUF architecture, config extras)
    # soft-capped scores (10) and logits (60); a window of 8 tokens on layers 0 and 2
    "gemma2": (
        ("Gemma2Config", "Gemma2ForCausalLM"),
        "gemma2",
        {
            "num_hidden_layers": 3,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,  # llama.cpp's query scale is 1 / sqrt(key_length)
            "sliding_window": 8,
            "attn_logit_softcapping": 10.0,
            "final_logit_softcapping": 60.0,
        },
    ),
    # Gemma 3 as the converter writes it: q/k norms; layers 0-4 slide the window and rotate with
    # base 10,000, layer 5 attends to everything with base 1,000,000
    "gemma3": (
        ("Gemma3TextConfig", "Gemma3ForCausalLM"),
        "gemma3",
        {
            "num_hidden_layers": 6,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 8,
            "rope_theta": 1_000_000.0,
        },
    ),
    # the keys the converter writes only where a model has them (a logit soft-cap, linear rope
    # scaling of the full layers) and two that newer llama.cpp reads (every 3rd layer full, the
    # sliding layers' own rope base)
    "gemma3-keys": (
        ("Gemma3TextConfig", "Gemma3ForCausalLM"),
        "gemma3",
        {
            "num_hidden_layers": 3,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 8,
            "sliding_window_pattern": 3,
            "rope_theta": 1000.0,
            "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "final_logit_softcapping": 30.0,
        },
    ),
}
# The config keys transformers' GGUF loading does not read from these files (it keeps the config
# class's defaults: soft-caps 50 and 30, query_pre_attn_scalar 256, Gemma 3's rope bases and
# pattern); its model of the file is given the original's values of them.
_TRANSFORMERS_GGUF_GAPS = {
    "gemma2": ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"),
    "gemma3": (
        "query_pre_attn_scalar",
        "final_logit_softcapping",
        "rope_parameters",
        "layer_types",
    ),
}


@pytest.fixture(scope="module", params=sorted(GEMMA))
def gemma(request) -> tuple[Any, dict[str, Any], str]:
    """(the seeded transformers model, the config dict write_gguf reads, GGUF architecture)."""
    transformers = pytest.importorskip("transformers")
    (config_cls, model_cls), arch, extra = GEMMA[request.param]
    hf = {**SHAPE, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, **extra}
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**hf)).eval()
    peaked_weights(model, seed=len(request.param))
    return model, hf, arch


@pytest.mark.parametrize("qtype", ["F32", "F16"])
def test_gemma_matches_transformers(gemma, qtype: str, generate, tmp_path: Path):
    """A Gemma 2 / Gemma 3 file written as convert_hf_to_gguf writes it (norms stored as 1 + w,
    llama.cpp's tensor names, no Q/K permutation, its metadata) loads as the original model:
    the same config and weights (norms back to w), and logits within 1e-4 and the same greedy
    tokens, through the model and the engine, as transformers' model of the same file and, where
    the file holds the original's float32 weights, as the original itself. Prompts and
    continuations run past the window of 8 tokens, and the window changes the logits."""
    transformers = pytest.importorskip("transformers")
    model, hf, arch = gemma
    state = model.state_dict()
    path = write_gguf(tmp_path / "gemma.gguf", state, hf, qtype, arch)
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert "output.weight" not in stored and "blk.0.post_ffw_norm.weight" in stored
    config, ours, tokenizer = load_checkpoint(path, DEVICE, torch.float32)
    assert tokenizer is None and config.tie_word_embeddings
    assert config.model_type == model.config.model_type
    kinds = model.config.layer_types
    assert config.sliding_window == 8 and 0 < len(config.sliding_layers) < config.num_layers
    assert config.sliding_layers == tuple(
        i for i, k in enumerate(kinds) if k == "sliding_attention"
    )
    caps = (model.config.attn_logit_softcapping, model.config.final_logit_softcapping)
    assert (config.attn_softcap, config.final_softcap) == caps
    assert config.attention_multiplier == pytest.approx(32**-0.5)
    if arch == "gemma3":
        ropes = model.config.rope_parameters
        assert config.local_rope_theta == ropes["sliding_attention"]["rope_theta"]
        assert config.rope_theta == ropes["full_attention"]["rope_theta"]
        assert config.rope_scaling == hf.get("rope_scaling")
    loaded = {name: tensor.cpu() for name, tensor in ours.state_dict().items()}
    assert loaded.keys() == {k for k in state if k != "lm_head.weight"}
    for name, tensor in loaded.items():
        if name.endswith("norm.weight"):  # stored as 1 + w in float32: w again, to its rounding
            torch.testing.assert_close(tensor, state[name], atol=1e-6, rtol=0)
        else:
            bound = 0 if qtype == "F32" else 1e-3  # float16's rounding (and its subnormals)
            torch.testing.assert_close(tensor, state[name], atol=bound * 1e-3, rtol=bound)

    gen = torch.Generator().manual_seed(8)  # 11, 3 and 20 tokens, and 8 more of each
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (11, 3, 20)]
    unwindowed = LlamaModel(replace(config, sliding_window=64))  # 64: as long as the cache
    unwindowed.load_state_dict(loaded)
    windowed = _logits(ours, prompts)
    assert not torch.allclose(_logits(unwindowed.to(DEVICE), prompts), windowed, atol=1e-3)
    gaps = {key: getattr(model.config, key) for key in _TRANSFORMERS_GGUF_GAPS[arch]}
    from_file = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, **gaps
    ).eval()
    _assert_same_as_transformers(ours, from_file, prompts, generate)
    if qtype == "F32":  # the original's weights exactly: its logits too
        _assert_same_as_transformers(ours, model, prompts, generate)
    else:  # its weights rounded to float16: its greedy tokens
        for prompt, tokens in zip(prompts, generate(ours, prompts, 8), strict=True):
            assert hf_greedy(model, prompt, 8) == tokens


def test_gemma1_matches_the_original(generate, tmp_path: Path):
    """A Gemma 1 file as convert_hf_to_gguf's GemmaModel writes it (norms stored as 1 + w, no
    output tensor, no rope base) loads as the original: Llama's layer with Gemma's norms, GeGLU,
    √hidden embeddings and queries scaled by 1 / sqrt(key_length); the same weights, and logits
    within 1e-4 and greedy tokens equal to the original's (transformers' GGUF loading does not
    read gemma files)."""
    transformers = pytest.importorskip("transformers")
    hf = {**SHAPE, "rms_norm_eps": 1e-6, "head_dim": 32}
    model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**hf)).eval()
    peaked_weights(model, seed=1)
    state = model.state_dict()
    path = write_gguf(tmp_path / "gemma.gguf", state, hf, "F32", "gemma")
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}
    config, ours, _ = load_checkpoint(path, DEVICE, torch.float32)
    assert (config.model_type, config.head_dim, config.tie_word_embeddings) == ("gemma", 32, True)
    assert config.attention_multiplier is None and config.sliding_window is None
    loaded = {name: tensor.cpu() for name, tensor in ours.state_dict().items()}
    assert loaded.keys() == {k for k in state if k != "lm_head.weight"}
    for name, tensor in loaded.items():  # norms stored as 1 + w in float32: w to its rounding
        torch.testing.assert_close(tensor, state[name], atol=1e-6, rtol=0)
    _assert_same_as_transformers(ours, model, _prompts(128, seed=2), generate)


# ---- (d) Qwen3-MoE: experts stacked in one tensor per product -----------------------------


def _qwen3moe_file(
    model: Any, hf: dict[str, Any], path: Path, qtype: str, experts: int | None = None
) -> Path:
    """convert_hf_to_gguf's Qwen3MoeModel: each layer's experts as ffn_gate_exps, ffn_up_exps
    ([experts, inner, hidden]) and ffn_down_exps, the router as ffn_gate_inp, and the expert
    keys of its metadata; `experts`: only the first so many in the stacked tensors."""
    state, stacked = {}, {}
    for name, tensor in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers: [experts, 2 x inner, hidden]
            layer = name.split(".")[2]
            gate, up = tensor[:experts].chunk(2, dim=1)
            stacked[f"blk.{layer}.ffn_gate_exps.weight"] = gate.numpy()
            stacked[f"blk.{layer}.ffn_up_exps.weight"] = up.numpy()
        elif name.endswith("mlp.experts.down_proj"):
            stacked[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"] = tensor[:experts].numpy()
        elif name.endswith("mlp.gate.weight"):
            stacked[f"blk.{name.split('.')[2]}.ffn_gate_inp.weight"] = tensor.numpy()
        else:
            state[name] = tensor
    return write_gguf(path, state, hf, qtype, "qwen3moe", extra_2d=stacked)


QWEN3_MOE = {  # top 2 of 8 experts of 32, every layer routed, as llama.cpp's qwen3moe computes
    **SHAPE,
    "rms_norm_eps": 1e-6,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "rope_theta": 10000.0,
}


def test_qwen3_moe_matches_transformers(generate, tmp_path: Path):
    """A Qwen3-MoE file as llama.cpp writes it (top 2 of 8 experts, every layer routed) loads
    as the original model: each expert split out of the stacked tensors, the same weights, and
    logits within 1e-4 and greedy tokens equal to transformers' model of the same file (its own
    GGUF loader) and to the original."""
    transformers = pytest.importorskip("transformers")
    hf = QWEN3_MOE
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**hf)).eval()
    peaked_weights(model, seed=9)
    path = _qwen3moe_file(model, hf, tmp_path / "qwen3moe.gguf", "F32")
    config, ours, _ = load_checkpoint(path, DEVICE, torch.float32)
    assert (config.model_type, config.num_experts, config.experts_per_token) == ("qwen3_moe", 8, 2)
    assert config.moe_intermediate_size == 32 and config.norm_topk_prob and not config.dense_layers
    loaded = ours.state_dict()
    for e in (0, 7):
        gate, up = model.model.layers[1].mlp.experts.gate_up_proj[e].chunk(2, dim=0)
        assert torch.equal(loaded[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"].cpu(), gate)
        assert torch.equal(loaded[f"model.layers.1.mlp.experts.{e}.up_proj.weight"].cpu(), up)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (11, 3, 20)]
    from_file = transformers.AutoModelForCausalLM.from_pretrained(  # it does not read the
        tmp_path, gguf_file=path.name, dtype=torch.float32, moe_intermediate_size=32
    ).eval()  # experts' size from the file: given here
    _assert_same_as_transformers(ours, from_file, prompts, generate)
    _assert_same_as_transformers(ours, model, prompts, generate)


def test_a_stacked_expert_tensor_of_the_wrong_count_is_one_line(tmp_path: Path):
    """The router and metadata say 8 experts, the stacked tensors hold 4: refused in one line
    before any weight is read."""
    transformers = pytest.importorskip("transformers")
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE)).eval()
    path = _qwen3moe_file(model, QWEN3_MOE, tmp_path / "short.gguf", "F32", experts=4)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(path, DEVICE, torch.float32)
    assert str(refused.value).startswith("short.gguf: missing tensor for model.layers.0.mlp.")


# ---- (e) Phi-3: fused products, a window, Phi-4-mini's partial rope and longrope -------------

PHI3 = {
    # Phi-3 mini's layout: qkv and gate_up fused, a sliding window on every layer
    "phi3": {"sliding_window": 8},
    # Phi-4-mini's: 3/4 of each head rotates, longrope (within its original context of 64
    # tokens: past it transformers recomputes whole sequences, docs/operations.md), tied
    # embeddings
    "phi4-mini": {
        "partial_rotary_factor": 0.75,
        "tie_word_embeddings": True,
        "original_max_position_embeddings": 64,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(6)],
            "long_factor": [1.0 + 2.0 * i for i in range(6)],
        },
    },
}


@pytest.mark.parametrize("variant", sorted(PHI3))
def test_phi3_matches_the_original(variant: str, generate, tmp_path: Path):
    """A Phi-3 file as llama.cpp writes it loads as the original model: its fused qkv and
    gate_up split into the model's products, the window, the rotated share of each head, and
    longrope's factors (stored as tensors) read back; logits within 1e-4 and greedy tokens equal
    to the original's, through the model and the engine, prompts and continuations past the
    window. Phi-3 mini's file is also held to transformers' own GGUF loader."""
    transformers = pytest.importorskip("transformers")
    hf = {**SHAPE, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "pad_token_id": 0}
    hf |= PHI3[variant]
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**hf)).eval()
    peaked_weights(model, seed=len(variant))
    state = model.state_dict()
    if hf.get("tie_word_embeddings"):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    extra = {}
    if "rope_scaling" in hf:
        extra = {
            "rope_factors_long.weight": np.array(hf["rope_scaling"]["long_factor"], np.float32),
            "rope_factors_short.weight": np.array(hf["rope_scaling"]["short_factor"], np.float32),
        }
    path = write_gguf(tmp_path / f"{variant}.gguf", state, hf, "F32", "phi3", extra=extra)
    config, ours, _ = load_checkpoint(path, DEVICE, torch.float32)
    assert config.model_type == "phi3"
    assert config.sliding_window == hf.get("sliding_window")
    assert config.rotary_dim == int(16 * hf.get("partial_rotary_factor", 1.0))
    if "rope_scaling" in hf:
        assert config.rope_scaling is not None
        assert config.rope_scaling["long_factor"] == pytest.approx(
            extra["rope_factors_long.weight"]
        )
        assert config.rope_scaling["original_max_position_embeddings"] == 64
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (11, 3, 20)]
    _assert_same_as_transformers(ours, model, prompts, generate)
    if variant == "phi3":
        from_file = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=path.name, dtype=torch.float32, sliding_window=8, pad_token_id=0
        ).eval()
        _assert_same_as_transformers(ours, from_file, prompts, generate)


# ---- (f) gpt-oss: sinks, biased experts stacked per product, MXFP4 ---------------------------


def _on_ggml_mxfp4_grid(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [..., out, in] rounded as llama.cpp's MXFP4 stores it (blocks of 32 along `in`),
    so that a file of it holds the original's values exactly."""
    kind = gguf.GGMLQuantizationType.MXFP4
    flat = weight.reshape(-1, weight.shape[-1]).numpy()
    back = gguf.quants.dequantize(gguf.quants.quantize(flat, kind), kind)
    return torch.from_numpy(np.array(back, dtype=np.float32)).reshape(weight.shape)


def _gpt_oss_file(model: Any, hf: dict[str, Any], path: Path) -> Path:
    """convert_hf_to_gguf's GptOssModel: the experts' gate and up de-interleaved into
    ffn_gate_exps / ffn_up_exps and down into ffn_down_exps ([experts, out, in], MXFP4), their
    biases beside them, the sinks as attn_sinks.weight, the router as ffn_gate_inp, and yarn's
    keys."""
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_key_length(hf["head_dim"])
    writer.add_value_length(hf["head_dim"])
    writer.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_expert_count(hf["num_local_experts"])
    writer.add_expert_used_count(hf["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(hf["intermediate_size"])
    writer.add_sliding_window(hf["sliding_window"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(hf["rope_parameters"]["factor"])
    writer.add_rope_scaling_orig_ctx_len(hf["rope_parameters"]["original_max_position_embeddings"])
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, hf["num_hidden_layers"])
    for name, tensor in model.state_dict().items():
        values = tensor.float()
        if name.endswith("experts.gate_up_proj"):
            gate_up = values.transpose(-1, -2)
            stem = name.replace("model.layers.", "blk.").replace("mlp.experts.gate_up_proj", "")
            _add(writer, f"{stem}ffn_gate_exps.weight", gate_up[:, ::2].numpy(), "MXFP4")
            _add(writer, f"{stem}ffn_up_exps.weight", gate_up[:, 1::2].numpy(), "MXFP4")
        elif name.endswith("experts.gate_up_proj_bias"):
            stem = name.replace("model.layers.", "blk.").replace(
                "mlp.experts.gate_up_proj_bias", ""
            )
            _add(writer, f"{stem}ffn_gate_exps.bias", values[:, ::2].numpy(), "F32")
            _add(writer, f"{stem}ffn_up_exps.bias", values[:, 1::2].numpy(), "F32")
        elif name.endswith("experts.down_proj"):
            stem = name.replace("model.layers.", "blk.").replace("mlp.experts.down_proj", "")
            _add(writer, f"{stem}ffn_down_exps.weight", values.mT.numpy(), "MXFP4")
        elif name.endswith("experts.down_proj_bias"):
            stem = name.replace("model.layers.", "blk.").replace("mlp.experts.down_proj_bias", "")
            _add(writer, f"{stem}ffn_down_exps.bias", values.numpy(), "F32")
        else:
            stem, suffix = name.rsplit(".", 1) if not name.endswith("sinks") else (name, "weight")
            _add(writer, f"{names.get_name(stem)}.{suffix}", values.numpy(), "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gpt_oss_matches_the_original(generate, tmp_path: Path):
    """A gpt-oss file as llama.cpp writes it (MXFP4 experts, F32 elsewhere) loads as the
    original model with its experts on MXFP4's grid: the same weights, gate and up interleaved
    back, and logits within 1e-4 and greedy tokens equal to the original's, through the model
    and the engine, on prompts past the window of 8."""
    transformers = pytest.importorskip("transformers")
    # the equivalence tests' gpt-oss, with llama.cpp's SwiGLU clamp (a constant there)
    hf = {**SHAPE, **HF_VARIANTS["gpt-oss"][2], "swiglu_limit": 7.0, "rms_norm_eps": 1e-5}
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**hf)).eval()
    peaked_weights(model, seed=13)
    with torch.no_grad():
        for layer in model.model.layers:
            experts = layer.mlp.experts
            gate_up = experts.gate_up_proj.transpose(-1, -2)
            experts.gate_up_proj.copy_(_on_ggml_mxfp4_grid(gate_up).transpose(-1, -2))
            down = experts.down_proj.transpose(-1, -2)
            experts.down_proj.copy_(_on_ggml_mxfp4_grid(down).transpose(-1, -2))
    path = _gpt_oss_file(model, hf, tmp_path / "gpt-oss.gguf")
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if "exps.weight" in t.name}
    assert kinds == {"MXFP4"}
    config, ours, _ = load_checkpoint(path, DEVICE, torch.float32)
    assert (config.model_type, config.num_experts, config.experts_per_token) == ("gpt_oss", 4, 2)
    assert config.attention_sinks and config.sliding_layers == (0, 2)
    assert config.rope_scaling is not None and config.rope_scaling["truncate"] is False
    loaded = {name: tensor.cpu() for name, tensor in ours.state_dict().items()}
    assert loaded.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (11, 3, 20)]
    _assert_same_as_transformers(ours, model, prompts, generate)


_GEMMA_META = {  # a Gemma file's common keys, without its architecture's prefix
    "context_length": 8192,
    "embedding_length": 64,
    "block_count": 12,
    "feed_forward_length": 128,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
    "attention.key_length": 32,
    "attention.value_length": 32,
    "attention.layer_norm_rms_epsilon": 1e-6,
}
_EMBEDDINGS = SimpleNamespace(shape=(64, 128), tensor_type=SimpleNamespace(name="F32"))


def _gemma_config(arch: str, keys: dict[str, Any] | None = None, tensors: Sequence[str] = ()):
    """The config kvctl reads from a Gemma file's metadata: `_GEMMA_META` and `keys`, both
    without the architecture's prefix, and the tensor names `tensors` beside token_embd."""
    from kvctl.agent.model.gguf_metadata import config_from_metadata

    given = {**_GEMMA_META, **(keys or {})}
    meta = {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in given.items()}}
    files = {"token_embd.weight": _EMBEDDINGS, **{name: _EMBEDDINGS for name in tensors}}
    return config_from_metadata(meta, files, Path(f"{arch}.gguf"))


def test_gemma_metadata_defaults_are_llama_cpps():
    """What llama.cpp assumes where a Gemma file says nothing: Gemma 2 slides a window of 4,096
    on every other layer and caps scores at 50 and logits at 30; Gemma 3 makes every 6th layer
    full, rotates the sliding layers with base 10,000, and slides nothing without a window; the
    27B models (46 and 62 layers) scale queries by hidden / heads instead of key_length."""
    gemma2 = _gemma_config("gemma2")
    assert gemma2.model_type == "gemma2" and gemma2.sliding_window == 4096
    assert gemma2.sliding_layers == tuple(range(0, 12, 2))
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (50.0, 30.0)
    assert gemma2.attention_multiplier == pytest.approx(32**-0.5)
    assert gemma2.local_rope_theta is None
    gemma3 = _gemma_config("gemma3", {"attention.sliding_window": 512, "rope.freq_base": 1e6})
    assert gemma3.model_type == "gemma3_text" and gemma3.sliding_window == 512
    assert gemma3.sliding_layers == tuple(i for i in range(12) if i not in (5, 11))
    assert (gemma3.attn_softcap, gemma3.final_softcap) == (None, None)
    assert (gemma3.rope_theta, gemma3.local_rope_theta) == (1e6, 10000.0)
    for window in ({}, {"attention.sliding_window": 0}):
        assert _gemma_config("gemma3", window).sliding_layers == ()
    # a window as long as the context is none, but the sliding layers keep their own rope
    spanning = _gemma_config("gemma3", {"attention.sliding_window": 8192, "rope.freq_base": 1e6})
    assert spanning.sliding_window is None and spanning.local_rope(0)
    assert not spanning.local_rope(5)
    patterned = _gemma_config(
        "gemma3",
        {
            "attention.sliding_window": 8,
            "attention.sliding_window_pattern": 4,
            "rope.freq_base_swa": 100.0,
        },
    )
    assert patterned.sliding_layers == (0, 1, 2, 4, 5, 6, 8, 9, 10)
    assert patterned.local_rope_theta == 100.0
    everywhere = {"attention.sliding_window": 8, "attention.sliding_window_pattern": 0}
    assert _gemma_config("gemma3", everywhere).sliding_layers == tuple(range(12))
    for arch, layers, scalar in (("gemma2", 46, 16), ("gemma3", 62, 16), ("gemma3", 61, 32)):
        config = _gemma_config(arch, {"block_count": layers})
        assert config.attention_multiplier == pytest.approx(scalar**-0.5)


GEMMA_REFUSED = {  # (architecture, metadata, extra tensors) -> the refusal
    "gemma2 pattern": (
        ("gemma2", {"attention.sliding_window_pattern": 3}, ()),
        "gemma2.gguf: gemma2.attention.sliding_window_pattern 3 is not supported; llama.cpp's "
        "gemma2 slides the window on every other layer",
    ),
    "gemma3 per-layer pattern": (
        ("gemma3", {"attention.sliding_window_pattern": [True, False] * 6}, ()),
        "gemma3.gguf: gemma3.attention.sliding_window_pattern [True, False, True, False, True, "
        "Fals... is not supported; kvctl reads one number of layers",
    ),
    "gemma3 attention soft-cap": (
        ("gemma3", {"attn_logit_softcapping": 50.0}, ()),
        "gemma3.gguf: gemma3.attn_logit_softcapping is not supported; llama.cpp's gemma3 does "
        "not soft-cap attention scores",
    ),
    "gemma output tensor": (
        ("gemma", {}, ("output.weight",)),
        "gemma.gguf: unexpected tensor output.weight; llama.cpp's gemma ties the output to "
        "token_embd.weight",
    ),
    "gemma2 output tensor": (
        ("gemma2", {}, ("output.weight",)),
        "gemma2.gguf: unexpected tensor output.weight; llama.cpp's gemma2 ties the output to "
        "token_embd.weight",
    ),
    "gemma2 sliding rope base": (
        ("gemma2", {"rope.freq_base_swa": 100.0}, ()),
        "gemma2.gguf: gemma2.rope.freq_base_swa is not supported; llama.cpp's gemma2 rotates "
        "every layer with rope.freq_base",
    ),
    "gemma2 zero soft-cap": (
        ("gemma2", {"attn_logit_softcapping": 0.0}, ()),
        "gemma2.gguf: metadata attn_logit_softcapping must be a positive finite number, got 0.0",
    ),
}


@pytest.mark.parametrize("case", sorted(GEMMA_REFUSED))
def test_gemma_metadata_kvctl_cannot_follow_is_refused(case: str):
    (arch, keys, tensors), message = GEMMA_REFUSED[case]
    with pytest.raises(CheckpointError) as info:
        _gemma_config(arch, keys, tensors)
    assert str(info.value) == message


# ---- Llama 3.1 rope factors ----------------------------------------------------------------


def _demo_file(tmp_path: Path, rope_freqs: np.ndarray | None) -> Path:
    _, demo, _ = build_demo_model()
    hf = {
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "intermediate_size": 688,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "vocab_size": 258,
        "bos_token_id": 256,
        "eos_token_id": 257,
    }
    extra = {"rope_freqs.weight": rope_freqs} if rope_freqs is not None else None
    return write_gguf(tmp_path / "demo.gguf", demo.state_dict(), hf, extra=extra)


def test_llama31_rope_factors_are_recognised(tmp_path: Path):
    """convert_hf_to_gguf stores Llama 3.1 rope scaling as divisors of the base frequencies."""
    from kvctl.agent.model.rope import inv_frequencies

    path = _demo_file(tmp_path, None)
    plain, _, _ = load_checkpoint(path)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    from dataclasses import replace

    factors = inv_frequencies(plain) / inv_frequencies(replace(plain, rope_scaling=scaling))
    config, _, _ = load_checkpoint(_demo_file(tmp_path, factors.numpy()))
    assert config.rope_scaling == scaling
    with pytest.raises(CheckpointError, match=r"rope factors other than Llama 3\.1's"):
        load_checkpoint(_demo_file(tmp_path, (factors * 1.5).numpy()))


# ---- (c) bad files: one line each ----------------------------------------------------------


def _good(tmp_path: Path) -> Path:
    return _demo_file(tmp_path, None)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _rewrite(path: Path, **changes: Any) -> None:
    """The demo file again, with one thing about it changed."""
    _, demo, _ = build_demo_model()
    state = demo.state_dict()
    writer = gguf.GGUFWriter(str(path), changes.get("arch", "llama"))
    writer.add_context_length(64)
    writer.add_embedding_length(256)
    writer.add_block_count(4)
    writer.add_feed_forward_length(688)
    writer.add_head_count(8)
    writer.add_head_count_kv(4)
    for key, value in changes.get("metadata", {}).items():
        writer.add_string(key, value)
    for name, tensor in state.items():
        values = tensor.numpy()
        if name == "model.embed_tokens.weight" and "raw" in changes:
            writer.add_tensor(
                "token_embd.weight",
                values.astype(np.int8),
                raw_dtype=gguf.GGMLQuantizationType.I8,
            )
            continue
        target = _TOP.get(name) or "blk.{}.{}.{}".format(
            name.split(".")[2], _BLOCK[".".join(name.split(".")[3:-1])], name.split(".")[-1]
        )
        writer.add_tensor(target, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


BAD = {
    "missing file": (lambda p: p.unlink(), "demo.gguf: no such GGUF file"),
    "wrong magic": (
        lambda p: p.write_bytes(b"PK\x03\x04" + p.read_bytes()[4:]),
        "demo.gguf: not a GGUF file (starts with b'PK\\x03\\x04', not b'GGUF')",
    ),
    "truncated": (_truncate, "demo.gguf: truncated"),
    "header only": (lambda p: p.write_bytes(p.read_bytes()[:40]), "demo.gguf: truncated"),
    "unsupported architecture": (
        lambda p: _rewrite(p, arch="falcon"),
        "demo.gguf: unsupported architecture 'falcon'; kvctl loads GGUF files of architecture "
        "llama, qwen2, qwen3, qwen3moe, phi3, gemma, gemma2, gemma3, gpt-oss (Llama, Mistral, "
        "Qwen2, Qwen3, Qwen3-MoE, Phi-3, Gemma, Gemma 2, Gemma 3 and gpt-oss text decoders)",
    ),
    "unsupported quantization type": (
        lambda p: _rewrite(p, raw=True),
        "demo.gguf: token_embd.weight is stored as I8, a type kvctl cannot dequantize",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_file_is_one_clear_line(tmp_path: Path, case: str):
    path = _good(tmp_path)
    break_it, message = BAD[case]
    break_it(path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert message in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_tokenizer_model_is_refused():
    from kvctl.agent.model.gguf_tokenizer import gguf_tokenizer

    meta = {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(
        CheckpointError, match=r"m\.gguf: tokenizer\.ggml\.model 't5' is not supported"
    ):
        gguf_tokenizer(meta, "m.gguf", 2)
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a"],
        "tokenizer.ggml.pre": "x",
    }
    with pytest.raises(CheckpointError, match=r"tokenizer\.ggml\.pre 'x' is not supported"):
        gguf_tokenizer(meta, "m.gguf", 2)


@pytest.mark.slow
def test_agent_refuses_a_bad_gguf_with_one_line(tmp_path: Path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"nope")
    result = subprocess.run(
        [sys.executable, "-m", "kvctl.agent.startup.main", "--port", "0", "--model", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "level=" not in line]
    assert errors == [
        f"kvctl-agent: error: --model {path}: bad.gguf: not a GGUF file "
        "(starts with b'nope', not b'GGUF')"
    ], result.stderr


def test_agent_builds_its_service_from_a_gguf(tmp_path: Path):
    from kvctl.agent.config import AgentConfig
    from kvctl.agent.startup.wiring import build_service

    path = _good(tmp_path)
    threads = torch.get_num_threads()
    config = AgentConfig(model=str(path), pool_pages=32, torch_threads=threads)
    service = build_service(config)
    assert list(service.pools) == ["demo"]
    engine = service.pool("demo").engine
    assert engine.model.config.max_position_embeddings == 4096
    request = engine.generate([[256, 104, 105]], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(request.output_ids) == 4


def test_sentencepiece_tokenizer_matches_transformers(tmp_path: Path):
    """A Llama-2 style vocabulary (byte fallback, merges implied by scores) gives transformers'
    ids: "▁" for spaces, BOS first, unknown characters as <0x..> bytes."""
    transformers = pytest.importorskip("transformers")
    from kvctl.agent.model.gguf_tokenizer import gguf_tokenizer
    from kvctl.agent.model.tokenizer import HFTokenizer

    pieces = ["▁", "t", "h", "e", "l", "o", "w", "r", "d", "a", "n", "th", "he", "the", "▁the"]
    pieces += ["ll", "llo", "▁w", "or", "ld", "▁h", "an", "▁and", "▁world", "▁hello", "wor"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    ours = HFTokenizer(gguf_tokenizer(meta, "spm.gguf", len(tokens)), (2,))
    for text in ["hello world", "the world and the hello", " the", "ü dé", "a\nb"]:
        assert ours.encode(text) == expected(text).input_ids, text
        assert ours.decode(ours.encode(text)) == expected.decode(
            expected(text).input_ids, skip_special_tokens=True
        ), text


def _assert_same_as_transformers(ours, expected, prompts: list[list[int]], generate) -> None:
    """Logits within 1e-4 and 8 greedy tokens equal to transformers' model of the same file,
    through the model (`generate`, the fixture) and through the engine."""
    with torch.no_grad():
        want = torch.cat([expected(torch.tensor([p])).logits[0] for p in prompts])
    torch.testing.assert_close(_logits(ours, prompts), want, atol=1e-4, rtol=1e-4)
    greedy = generate(ours, prompts, 8)
    assert _engine_greedy(ours, prompts, 8) == greedy
    for prompt, tokens in zip(prompts, greedy, strict=True):
        assert hf_greedy(expected, prompt, 8) == tokens
