"""Checkpoint loading: what a good directory yields, and one clear line per way it can be bad."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvctl.agent.model import CheckpointError, LlamaModel, ModelConfig, load_checkpoint

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def _state(hf: dict) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = LlamaModel(ModelConfig.from_hf(hf, "tiny"))
    return {name: t.contiguous() for name, t in model.state_dict().items()}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "tiny-llama"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(HF_CONFIG))
    save_file(_state(HF_CONFIG), root / "model.safetensors")
    return root


def _edit_config(**changes) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        hf = json.loads((root / "config.json").read_text())
        hf.update(changes)
        (root / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v != "DEL"}))

    return edit


def _edit_weights(edit_state: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        state = _state(HF_CONFIG)
        edit_state(state)
        save_file(state, root / "model.safetensors")

    return edit


def _shard_with_missing_file(root: Path) -> None:
    index = {"weight_map": {name: "model-00001-of-00002.safetensors" for name in _state(HF_CONFIG)}}
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (root / "model.safetensors").rename(root / "model-00001-of-00002.safetensors")
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


BAD = {
    "missing directory": (
        lambda root: root.rename(root.with_name("gone")),
        "tiny-llama: no such checkpoint directory",
    ),
    "no config.json": (
        lambda root: (root / "config.json").unlink(),
        "config.json: not found in",
    ),
    "invalid JSON": (
        lambda root: (root / "config.json").write_text("{'hidden_size': 64"),
        "config.json: invalid JSON",
    ),
    "unsupported architecture": (
        _edit_config(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
        "config.json: unsupported architecture 'GPT2LMHeadModel'; "
        "kvctl runs Llama, Mistral and Qwen2 style decoders",
    ),
    "architecture disagrees with model_type": (
        _edit_config(architectures=["Qwen2ForCausalLM"]),
        "config.json: architecture 'Qwen2ForCausalLM' does not match model_type 'llama'",
    ),
    "missing key": (
        _edit_config(hidden_size="DEL"),
        "config.json: missing required key 'hidden_size'",
    ),
    "bad head count": (
        _edit_config(num_key_value_heads=3),
        "config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3",
    ),
    "unsupported rope": (
        _edit_config(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
        "config.json: rope type 'yarn' is not supported",
    ),
    "no weights": (
        lambda root: (root / "model.safetensors").unlink(),
        "tiny-llama: no *.safetensors files",
    ),
    "missing tensor": (
        _edit_weights(lambda s: s.pop("model.layers.1.mlp.up_proj.weight")),
        "model.safetensors: missing tensor model.layers.1.mlp.up_proj.weight",
    ),
    "wrong shape": (
        _edit_weights(
            lambda s: s.update({"model.layers.0.self_attn.q_proj.weight": torch.ones(64, 32)})
        ),
        "model.safetensors: model.layers.0.self_attn.q_proj.weight has shape [64, 32], "
        "config.json implies [64, 64]",
    ),
    "unexpected tensor": (
        _edit_weights(lambda s: s.update({"model.layers.0.mlp.extra.weight": torch.ones(2)})),
        "model.safetensors: unexpected tensor model.layers.0.mlp.extra.weight",
    ),
    "tensor in two files": (
        lambda root: (root / "extra.safetensors").write_bytes(
            (root / "model.safetensors").read_bytes()
        ),
        "model.safetensors: tensor lm_head.weight is also in extra.safetensors",
    ),
    "corrupt weights": (
        lambda root: (root / "model.safetensors").write_bytes(b"\x07not safetensors"),
        "model.safetensors: not a readable safetensors file",
    ),
    "index names a missing shard": (
        _shard_with_missing_file,
        "model.safetensors.index.json: lists model-00002-of-00002.safetensors, which is not in",
    ),
    "invalid generation_config.json": (
        lambda root: (root / "generation_config.json").write_text("nope"),
        "generation_config.json: invalid JSON",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoint_is_one_clear_line(ckpt: Path, case: str):
    break_it, message = BAD[case]
    break_it(ckpt)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, "cpu")
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_good_checkpoint_loads(ckpt: Path):
    config, model, tokenizer = load_checkpoint(ckpt, "cpu")
    assert config.name == "tiny-llama"
    assert config.eos_token_ids == (2,)
    assert tokenizer is None
    expected = _state(HF_CONFIG)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert not any(p.requires_grad for p in model.parameters())


def test_rotary_buffers_and_tied_lm_head_are_ignored(ckpt: Path):
    _edit_config(tie_word_embeddings=True)(ckpt)
    state = _state({**HF_CONFIG, "tie_word_embeddings": True})
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    state["lm_head.weight"] = torch.zeros(32, 64)
    save_file(state, ckpt / "model.safetensors")
    _, model, _ = load_checkpoint(ckpt, "cpu")
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(model.logits(hidden), hidden @ state["model.embed_tokens.weight"].T)


def test_dtype_follows_checkpoint_unless_given(ckpt: Path):
    _edit_config(torch_dtype="bfloat16")(ckpt)
    config, model, _ = load_checkpoint(ckpt, "cpu")
    assert config.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    _, model32, _ = load_checkpoint(ckpt, "cpu", dtype=torch.float32)
    assert {p.dtype for p in model32.parameters()} == {torch.float32}


def test_generation_config_eos_and_tokenizer_json(ckpt: Path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "pages": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    config, _, tokenizer = load_checkpoint(ckpt, "cpu")
    assert config.eos_token_ids == (2, 4)
    assert tokenizer is not None and tokenizer.eos_token_ids == (2, 4)
    assert tokenizer.encode("hello pages") == [3, 4]
    assert tokenizer.decode([1, 3, 4, 2]) == "hello pages"
    assert tokenizer.vocab_size == 5


def test_from_hf_reads_old_and_new_rope_layouts():
    old = {**HF_CONFIG, "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    new = {
        **HF_CONFIG,
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
    }
    new.pop("rope_theta")
    a, b = ModelConfig.from_hf(old, "m"), ModelConfig.from_hf(new, "m")
    assert a == b
    assert a.rope_theta == 500000.0 and a.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_from_hf_qwen2_bias_and_mistral_window():
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    qwen = ModelConfig.from_hf({**HF_CONFIG, **qwen2}, "q")
    assert (qwen.model_type, qwen.attention_bias, qwen.o_proj_bias) == ("qwen2", True, False)
    llama = ModelConfig.from_hf({**HF_CONFIG, "attention_bias": True}, "l")
    assert (llama.attention_bias, llama.o_proj_bias) == (True, True)
    mistral = {**HF_CONFIG, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    windowed = ModelConfig.from_hf({**mistral, "sliding_window": 64}, "m")
    assert (windowed.sliding_window, windowed.max_context_len) == (64, 64)
    unwindowed = ModelConfig.from_hf({**mistral, "sliding_window": None}, "m")
    assert (unwindowed.sliding_window, unwindowed.max_context_len) == (None, 128)
