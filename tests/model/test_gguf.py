"""GGUF loading: files written the way llama.cpp's convert_hf_to_gguf writes them (tensor names,
Q/K rows permuted for its interleaved rotary, tokenizer and chat template in the metadata), read
back by kvctl and, as the reference, by transformers' own GGUF loader."""

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hf_reference import SHAPE, hf_greedy, peaked_weights
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
) -> Path:
    """A GGUF file as llama.cpp's converter writes it; 1-D tensors stay F32, as llama.cpp keeps
    norms and biases. `raw` holds already quantized `qtype` blocks, by GGUF tensor name, for the
    types the gguf package cannot quantize (K-quants); they are stored as they are."""
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    writer.add_name(path.stem)
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    writer.add_rope_dimension_count(head_dim)
    if head_dim != hf["hidden_size"] // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_rope_freq_base(hf["rope_theta"])
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
        if name.startswith("model.layers."):
            _, _, layer, *rest = name.split(".")
            target = f"blk.{layer}.{_BLOCK['.'.join(rest[:-1])]}.{rest[-1]}"
        else:
            target = _TOP[name]
        values = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            values = permute(values, heads)
        elif arch == "llama" and ".k_proj." in name:
            values = permute(values, kv_heads)
        if raw is not None and target in raw:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(target, raw[target], raw_dtype=kind)
        else:
            _add(writer, target, values, qtype if values.ndim == 2 else "F32")
    for target, values in (extra or {}).items():
        _add(writer, target, values, "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
    cache = ContiguousKVCache(config, max_seqs=len(prompts), max_len=64, device=DEVICE)
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
        "llama, qwen2, qwen3",
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
        [sys.executable, "-m", "kvctl.agent.main", "--port", "0", "--model", str(path)],
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
    from kvctl.agent.wiring import build_service

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
